"""What the user's optimizer can do under each strategy, decided from the optimizer alone (no
process group): which of its param groups take sparse gradients (a sparse gradient made dense
for the others), the parameter servers' update rule of a group (:class:`OptimizerSpec`), and
whether weight prediction has a rule for it (:func:`check_predictable`). The profiler, the plan's
checks and the runtimes ask here.

Sparse gradients:

``allreduce-sparse`` gives embedding tables sparse gradients, so that DDP exchanges only the
rows a batch touched (strategies/runtimes/dataparallel/allreduce.py). Of torch's optimizers only ``SGD``,
``Adagrad`` and ``SparseAdam`` have sparse kernels, and not with every option: SGD with
``weight_decay`` raises "add(sparse, dense) is not supported", Adagrad with ``weight_decay``
"not compatible with sparse gradients"; ``Adam``, ``AdamW``, ``RMSprop``, ``Adamax``,
``NAdam`` and the rest raise "does not support sparse gradients" (torch 2.13, checked).

The rule (:func:`takes_sparse_gradients`): a table's optimizer takes its sparse gradient when
its class is exactly one of :data:`SPARSE_KERNELS` (a subclass may override ``step``) and a
probe of that class with the table's param-group options steps a sparse gradient twice (the
second step runs the momentum path). Any other optimizer, a user's own class included, gets
the exchanged gradient made dense right before its step (:func:`densify`: ``to_dense`` sums
the rows the workers sent into a dense zero), so the update is the dense run's (the same
averaged gradient, summed in another order) and the exchange keeps its saving.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable

import torch

SPARSE_KERNELS = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


def _group_of(opt: torch.optim.Optimizer, param: torch.Tensor) -> dict | None:
    return next((g for g in opt.param_groups if any(p is param for p in g["params"])), None)


def takes_sparse_gradients(opt: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    """Whether ``opt`` steps ``param`` with a sparse gradient (the module docstring's rule).
    False for a parameter in none of its groups, and for any probe that raises."""
    group = _group_of(opt, param)
    if type(opt) not in SPARSE_KERNELS or group is None:
        return False
    options = {k: v for k, v in group.items() if k != "params"}
    probe = torch.nn.Parameter(torch.zeros(4, 2, dtype=param.dtype))
    try:
        trial = type(opt)([{"params": [probe], **options}])
        for _ in range(2):
            with warnings.catch_warnings():  # torch warns about skipped sparse invariant checks
                warnings.simplefilter("ignore", UserWarning)
                probe.grad = torch.sparse_coo_tensor(
                    torch.tensor([[0, 2, 0]]), torch.ones(3, 2, dtype=param.dtype), (4, 2)
                )
                trial.step()
    except Exception:  # noqa: BLE001 - whatever the class raises, it cannot step a sparse gradient
        return False
    return True


def dense_before_step(
    opt: torch.optim.Optimizer, named: Iterable[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, parameter)`` pairs of ``named`` (the tables given sparse gradients) whose
    optimizer cannot step a sparse gradient: :func:`densify` them before every step."""
    return [(n, p) for n, p in named if not takes_sparse_gradients(opt, p)]


def densify(params: Iterable[torch.Tensor]) -> None:
    """Replace every sparse ``.grad`` of ``params`` by its dense sum (duplicate rows added,
    untouched rows zero), in place of the optimizer's sparse kernel."""
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            p.grad = p.grad.to_dense()


MODES = ("exact", "lazy")


@dataclass(frozen=True)
class OptimizerSpec:
    """The server-side update rule and its hyper-parameters (torch.optim's names)."""

    kind: str  # "sgd" | "adagrad" | "adam"
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False  # AdamW
    lr_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    betas: tuple[float, float] = (0.9, 0.999)
    mode: str = "exact"

    def touched_rows_suffice(self) -> bool:
        """True when untouched rows provably do not change (zero gradient, zero update)."""
        if self.mode == "lazy":
            return True
        return self.weight_decay == 0 and (self.kind == "adagrad" or (self.kind == "sgd" and self.momentum == 0))


def spec_from_group(opt: torch.optim.Optimizer, group: dict, mode: str = "exact") -> OptimizerSpec:
    """The :class:`OptimizerSpec` of one param group of the user's optimizer.

    Raises ValueError (naming the optimizer and the fix) for an optimizer or option the
    parameter server cannot reproduce (maximize, amsgrad, other optimizer classes).
    """
    if mode not in MODES:
        raise ValueError(f"plan sparse_optimizer {mode!r}: choose one of {', '.join(MODES)}")
    name = type(opt).__name__
    if group.get("maximize", False):
        raise ValueError(
            f"optimizer(): {name}(maximize=True) is not supported on the parameter server; minimise the negated loss"
        )
    lr = float(group["lr"])
    if isinstance(opt, torch.optim.SGD):
        return OptimizerSpec(
            "sgd",
            lr,
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            nesterov=bool(group["nesterov"]),
            weight_decay=float(group["weight_decay"]),
            mode=mode,
        )
    if isinstance(opt, torch.optim.Adagrad):
        return OptimizerSpec(
            "adagrad",
            lr,
            weight_decay=float(group["weight_decay"]),
            lr_decay=float(group["lr_decay"]),
            initial_accumulator_value=float(group["initial_accumulator_value"]),
            eps=float(group["eps"]),
            mode=mode,
        )
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        if group.get("amsgrad", False):
            raise ValueError(
                f"optimizer(): {name}(amsgrad=True) is not supported on the parameter server; use amsgrad=False"
            )
        decoupled = isinstance(opt, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
        return OptimizerSpec(
            "adam",
            lr,
            weight_decay=float(group["weight_decay"]),
            decoupled_weight_decay=decoupled,
            eps=float(group["eps"]),
            betas=tuple(float(b) for b in group["betas"]),
            mode=mode,
        )
    raise ValueError(
        f"optimizer(): {name} cannot run on the parameter server; use SGD (with momentum), Adagrad, Adam or AdamW, or --strategy allreduce"
    )


def check_predictable(optimizer: torch.optim.Optimizer | None, where: str = "optimizer()") -> None:
    """Raise ValueError (one line naming ``where`` and the fix) if ``--schedule async-predict``
    has no prediction rule for ``optimizer``; None (a stage without parameters) is fine."""
    if optimizer is None:
        return
    name = type(optimizer).__name__
    fix = "use SGD, Adam or AdamW, or --schedule async-stash / async-2bw"
    if not isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam)):
        raise ValueError(
            f"{where} returned {name}: --schedule async-predict has no weight prediction rule for it; {fix}"
        )
    for group in optimizer.param_groups:
        if group.get("maximize") or group.get("nesterov"):
            flag = "maximize" if group.get("maximize") else "nesterov"
            raise ValueError(
                f"{where} returned {name}({flag}=True): --schedule async-predict has no weight prediction rule for it; {fix}"
            )
