"""The script's optimizer, as TorchRec's fused optimizer for the tables and as itself for the
rest, and what cannot be fused, refused in one line before start.

TorchRec updates a sharded table's rows inside backward with FBGEMM's table-batched kernel
(``apply_optimizer_in_backward``; ``optimizer_type_to_emb_opt_type`` maps torch's classes:
``SGD`` -> ``exact_sgd``, ``Adagrad`` -> ``exact_adagrad``), with options that both torch's
class and FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` take (``lr``, ``eps``).
:func:`fused_optimizer` reads the script's optimizer and gives that class with the same
hyper-parameters, so the tables follow the update one process would make: under ``SGD``
without momentum and ``Adagrad`` (``lr_decay`` 0, ``initial_accumulator_value`` 0) a row no
id of the step touched has a zero gradient and no update in torch either, so the fused update
is the dense one exactly.

Everything else is refused: momentum, weight decay, another class, one table in several
parameter groups with different options. ``Adam`` too: FBGEMM's CPU kernels have no Adam
("Optimizer adam is not supported in CPU mode", fbgemm-gpu-cpu 1.8.0), and on CUDA its Adam is
lazy (the moments of the touched rows only), not torch's.
"""

from __future__ import annotations

import torch

FLAG = "--strategy torchrec"


def _group(opt: torch.optim.Optimizer, param: torch.Tensor) -> dict:
    for g in opt.param_groups:
        if any(p is param for p in g["params"]):
            return {k: v for k, v in g.items() if k != "params"}
    raise ValueError(
        f"{FLAG}: optimizer() leaves an embedding table out of its parameter groups; give it every parameter"
    )


def _options(kind: type, g: dict) -> dict | str:
    """The fused kernel's options for torch options ``g`` of optimizer class ``kind``, or why
    none (a phrase)."""
    if isinstance(g.get("lr"), torch.Tensor):
        return "a tensor learning rate"
    if g.get("weight_decay", 0):
        return "weight_decay"
    if g.get("maximize") or g.get("differentiable"):
        return "maximize/differentiable"
    if kind is torch.optim.SGD:
        if g.get("momentum", 0) or g.get("nesterov"):
            return "momentum"
        return {"lr": g["lr"]}
    if kind is torch.optim.Adagrad:
        if g.get("lr_decay", 0) or g.get("initial_accumulator_value", 0):
            return "lr_decay/initial_accumulator_value"
        return {"lr": g["lr"], "eps": g["eps"]}
    return "its class"


def fused_optimizer(opt: torch.optim.Optimizer, tables: list[torch.Tensor]) -> tuple[type, dict, str]:
    """``(optimizer class, the fused kernel's options, a note)`` for the tables ``tables``
    (their weights in the user's model) of the script's optimizer ``opt``: every table must
    sit in groups of equal options. ``note`` is "" (a line to print, for a later
    optimizer whose fused update differs from torch's). Raises ValueError (one line naming the option and the way out) for
    an optimizer FBGEMM cannot fuse."""
    kind = type(opt)
    groups = [_group(opt, t) for t in tables]
    if any(g != groups[0] for g in groups):
        raise ValueError(
            f"{FLAG}: optimizer() gives the embedding tables different options; TorchRec fuses one "
            "optimizer for all tables: give them one parameter group"
        )
    options = _options(kind, groups[0]) if groups else {"lr": 0.0}
    if isinstance(options, str):
        raise ValueError(
            f"{FLAG}: optimizer() is {kind.__name__} with {options}, which TorchRec cannot fuse into its "
            "tables' backward; use SGD (no momentum) or Adagrad without it, or another strategy"
        )
    note = ""
    return kind, options, note


def check_optimizer(opt: torch.optim.Optimizer, model: torch.nn.Module, weights: list[str]) -> str:
    """:func:`fused_optimizer` for the user's ``model`` (tables by parameter name ``weights``),
    before any process starts: raises its ValueError; returns its note."""
    named = dict(model.named_parameters())
    return fused_optimizer(opt, [named[w] for w in weights])[2]
