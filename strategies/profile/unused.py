"""Which trainable parameters get no gradient in a step: what decides DDP's
``find_unused_parameters`` (strategies/dataparallel/ddp.py).

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

import time

import torch
from hpar.strategies.common.job import Job, call_user
from hpar.strategies.models.forward import call_model
from torch import nn

PROBE_STEPS = 4   # batches unused_parameters runs: a branch skipped every other step shows in 2
PROBE_BUDGET_S = 10.0   # ... but no more than 2 once this many seconds have passed


def missing_gradients(model: nn.Module) -> set[str]:
    """Names of ``model``'s trainable parameters (``requires_grad``; a tied parameter once)
    whose ``.grad`` is None: after ``zero_grad(set_to_none=True)`` and one backward, the ones
    that step did not use. A frozen parameter is left out, as DDP leaves it out."""
    return {name for name, p in model.named_parameters() if p.requires_grad and p.grad is None}


def unused_parameters(job: Job, batch_size: int, world_size: int, steps: int = PROBE_STEPS,
                      model: nn.Module | None = None, budget_s: float = PROBE_BUDGET_S) -> tuple[str, ...]:
    """Sorted names of the trainable parameters that got no gradient in at least one of
    ``steps`` forward/backward passes (the loss of ``loss()``) on worker 0's first batches
    (``data(0, world_size, batch_size)``) on the CPU, with ``model`` (as built with seed 0,
    e.g. by ``job.check_job``: its gradients are cleared and its ``sparse=`` flags restored
    after) or a model built here with seed 0; the caller's torch RNG state is restored.
    Embedding tables take sparse gradients here (cheap for large tables; which rows does not
    matter). No optimizer step. Stops after 2 steps once ``budget_s`` seconds have passed (a
    model that takes seconds a step). Raises JobError when the user's code does."""
    rng = torch.get_rng_state()
    if model is None:
        torch.manual_seed(0)
        model = job.build_model()
    tables = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    flags = [m.sparse for m in tables]
    training = model.training
    t0 = time.perf_counter()
    try:
        torch.manual_seed(0)
        model.train()
        for m in tables:
            m.sparse = True
        batches = job.batches(0, world_size, batch_size)
        unused: set[str] = set()
        for i in range(steps):
            if i >= 2 and time.perf_counter() - t0 > budget_s:
                break
            inputs, targets = next(batches)
            model.zero_grad(set_to_none=True)
            loss = job.compute_loss(call_user(job, "the model's forward", call_model, model, inputs), targets)
            call_user(job, "the backward pass", loss.backward)
            unused |= missing_gradients(model)
        return tuple(sorted(unused))
    finally:
        model.zero_grad(set_to_none=True)
        model.train(training)
        for m, flag in zip(tables, flags):
            m.sparse = flag
        torch.set_rng_state(rng)
