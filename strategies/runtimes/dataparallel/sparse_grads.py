"""Which optimizers take sparse gradients, and a sparse gradient made dense for the others.

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
            with warnings.catch_warnings():   # torch warns about skipped sparse invariant checks
                warnings.simplefilter("ignore", UserWarning)
                probe.grad = torch.sparse_coo_tensor(torch.tensor([[0, 2, 0]]), torch.ones(3, 2, dtype=param.dtype),
                                                     (4, 2))
                trial.step()
    except Exception:   # noqa: BLE001 - whatever the class raises, it cannot step a sparse gradient
        return False
    return True


def dense_before_step(opt: torch.optim.Optimizer, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, parameter)`` pairs of ``named`` (the tables given sparse gradients) whose
    optimizer cannot step a sparse gradient: :func:`densify` them before every step."""
    return [(n, p) for n, p in named if not takes_sparse_gradients(opt, p)]


def densify(params: Iterable[torch.Tensor]) -> None:
    """Replace every sparse ``.grad`` of ``params`` by its dense sum (duplicate rows added,
    untouched rows zero), in place of the optimizer's sparse kernel."""
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            p.grad = p.grad.to_dense()
