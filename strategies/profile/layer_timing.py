"""The layers the profiler (strategies/profile/profiler.py) times one by one: the model's
pipeline layers (a declared sequence, or the blocks torch's tracer cuts it between) or, where
it cannot be cut, its top-level children; running them in order, a loss under the workers'
precision, and per-layer times pooled over identical layers."""

from __future__ import annotations

import statistics

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hpar.strategies.job.contract import Job, JobError
from hpar.strategies.job.forward import inner_module
from hpar.strategies.job.layers import is_declared_sequence, model_layers
from hpar.strategies.job.traced import why_not_traceable


def pipeline_layers(model: nn.Module, examples=()) -> tuple[list[tuple[str, nn.Module]], bool, str]:
    """The model's layers (``strategies/job/layers.py``: ``model.hpar_layers()``, the top-level
    children of an ``nn.Sequential``, or the blocks torch's tracer cuts it between, traced on
    the first of ``examples``, the inputs of the batches to be timed) as ``(name, module)``
    pairs, whether a pipeline can cut them, and why not. A model that cannot be cut is
    profiled by its top-level children; ``hpar_layers()`` returning something unusable
    raises JobError. A traced model whose ``examples`` change shape cannot be cut (its graph
    is specialised to one shape)."""
    if is_declared_sequence(model):
        try:
            layers = model_layers(model)
        except ValueError as exc:
            raise JobError(str(exc)) from None
        if len(layers) < 2:
            return layers, False, "the sequence has fewer than 2 layers"
        return layers, True, ""
    children = list(inner_module(model).named_children())
    shapes = {tuple(tuple(t.shape) for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)) for x in examples}
    if len(shapes) > 1:
        return (
            children,
            False,
            (
                "its batches change shape (a traced pipeline needs one shape; pad sequences to one "
                "length) and it has no hpar_layers()"
            ),
        )
    reason = why_not_traceable(model)
    if reason or not examples:
        return children, False, f"not a sequence of layers: {reason or 'no batch to trace it on'}"
    try:
        return model_layers(model, examples[0]), True, ""
    except ValueError as exc:
        return children, False, str(exc)


def compose(layers: list[tuple[str, nn.Module]], inputs):
    """The layers applied in order to ``inputs``: the model's forward, cut."""
    for _, layer in layers:
        inputs = layer(inputs)
    return inputs


def cast_loss(job: Job, cast, run, inputs, targets):
    """The loss of one forward pass under the workers' precision (``cast``)."""
    with cast():
        return job.compute_loss(run(inputs), targets)


def median_or_zero(xs):
    """The median of ``xs``, 0.0 when empty."""
    return statistics.median(xs) if xs else 0.0


def pooled_layer_times(layers, activation_bytes, lay_f, lay_b) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds per layer, pooled over identical layers: layers of
    the same type, parameter shapes and output size do the same work, so each gets the
    median over all their repeats. This keeps timing noise from splitting a stack of equal
    layers unevenly into pipeline stages."""

    def kind(li):
        m = layers[li][1]
        return (type(m).__name__, tuple(tuple(p.shape) for p in m.parameters()), activation_bytes[li])

    groups: dict = {}
    for li in range(len(layers)):
        groups.setdefault(kind(li), []).append(li)
    fwd, bwd = [0.0] * len(layers), [0.0] * len(layers)
    for members in groups.values():
        f = median_or_zero([x[li] for x in lay_f for li in members])
        b = median_or_zero([x[li] for x in lay_b for li in members])
        for li in members:
            fwd[li], bwd[li] = f, b
    return fwd, bwd
