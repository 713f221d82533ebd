"""Which trainable parameters get no gradient in a step: what decides DDP's
``find_unused_parameters`` (strategies/ddp.py).

DDP's reducer waits for the gradient of every parameter it holds. A parameter left out of a
step's autograd graph (a branch some batches skip, a head the loss ignores) never reports
ready, and DDP fails at the next forward with "Expected to have finished reduction in the
prior iteration". ``find_unused_parameters=True`` avoids that by walking the autograd graph
from the outputs every step, which costs a traversal per step (BENCHMARKS.md 12) and makes
torch warn once per worker when nothing was unused. So hpar turns it on only where a step it
ran left a trainable parameter without a gradient: the profiler records them over its timed
steps (``Profile.unused_params``), and for a strategy named without profiling ``hpar run``
runs :func:`unused_parameters`, a few forward/backward steps on a model of its own.
"""
from __future__ import annotations

import torch
from hpar.strategies.job import Job, call_user
from torch import nn

PROBE_STEPS = 4   # batches unused_parameters runs: a branch skipped every other step shows in 2


def missing_gradients(model: nn.Module) -> set[str]:
    """Names of ``model``'s trainable parameters (``requires_grad``; a tied parameter once)
    whose ``.grad`` is None: after ``zero_grad(set_to_none=True)`` and one backward, the ones
    that step did not use. A frozen parameter is left out, as DDP leaves it out."""
    return {name for name, p in model.named_parameters() if p.requires_grad and p.grad is None}


def unused_parameters(job: Job, batch_size: int, world_size: int, steps: int = PROBE_STEPS) -> tuple[str, ...]:
    """Sorted names of the trainable parameters that got no gradient in at least one of
    ``steps`` forward/backward passes (mean loss of ``loss()``) on worker 0's first batches
    (``data(0, world_size, batch_size)``), run on the CPU on a model built with seed 0 (the
    caller's torch RNG state is restored). Embedding tables take sparse gradients here (cheap
    for large tables; which rows does not matter). No optimizer step: the parameters stay as
    built. Raises JobError when the user's code does (its file and line)."""
    rng = torch.get_rng_state()
    try:
        torch.manual_seed(0)
        model = job.build_model().train()
        for m in model.modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                m.sparse = True
        batches = job.batches(0, world_size, batch_size)
        unused: set[str] = set()
        for _ in range(steps):
            inputs, targets = next(batches)
            model.zero_grad(set_to_none=True)
            loss = job.compute_loss(call_user(job, "the model's forward", model, inputs), targets)
            call_user(job, "the backward pass", loss.backward)
            unused |= missing_gradients(model)
        return tuple(sorted(unused))
    finally:
        torch.set_rng_state(rng)
