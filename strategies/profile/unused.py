"""Which trainable parameters get no gradient in a step: what decides DDP's
``find_unused_parameters`` (strategies/runtimes/dataparallel/ddp.py).

DDP's reducer waits for the gradient of every parameter it holds. A parameter left out of a
step's autograd graph (a branch some batches skip, a head the loss ignores) never reports
ready, and DDP fails at the next forward with "Expected to have finished reduction in the
prior iteration". ``find_unused_parameters=True`` avoids that by walking the autograd graph
from the outputs every step, which costs a traversal per step (BENCHMARKS.md 12) and makes
torch warn once per worker when nothing was unused. So hpar turns it on only where a step it
ran left a trainable parameter without a gradient: the profiler records them over its timed
steps and over :func:`probe_unused`'s batches of several ranks (``Profile.unused_params``,
``Profile.unused_by_rank``), and for a strategy named without profiling ``hpar run`` runs
:func:`probe_unused`, a few forward/backward steps on a model of its own. Where routing leaves
a parameter unused that no probed batch did, the worker's step catches DDP's error and the
launcher restarts the run with ``find_unused_parameters`` on (launcher/run/runner.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from hpar.strategies.job.contract import Job
from hpar.strategies.job.user_errors import call_user
from hpar.strategies.job.forward import call_model
from torch import nn

PROBE_STEPS = 4  # batches probe_unused runs per rank: a branch skipped every other step shows in 2
PROBE_BUDGET_S = 10.0  # ... but no more than 2 once this many seconds have passed


def missing_gradients(model: nn.Module) -> set[str]:
    """Names of ``model``'s trainable parameters (``requires_grad``; a tied parameter once)
    whose ``.grad`` is None: after ``zero_grad(set_to_none=True)`` and one backward, the ones
    that step did not use. A frozen parameter is left out, as DDP leaves it out."""
    return {name for name, p in model.named_parameters() if p.requires_grad and p.grad is None}


RANKS = 4  # data streams the probe draws: ranks' batches may route to different experts (MoE)


@dataclass(frozen=True)
class Unused:
    """What the probe saw: ``params``, sorted names of the trainable parameters that got no
    gradient in at least one drawn batch; ``by_rank``: in some step the ranks' batches left
    different parameters without a gradient (a mixture of experts whose routing differs per
    rank), which FSDP2 cannot run: it reduce-scatters only the gradients a rank has, so
    the ranks' collectives differ in size."""

    params: tuple[str, ...] = ()
    by_rank: bool = False


def unused_parameters(
    job: Job,
    batch_size: int,
    world_size: int,
    steps: int = PROBE_STEPS,
    model: nn.Module | None = None,
    budget_s: float = PROBE_BUDGET_S,
) -> tuple[str, ...]:
    """Sorted names of the trainable parameters :func:`probe_unused` found without a gradient."""
    return probe_unused(job, batch_size, world_size, steps, model, budget_s).params


def probe_unused(
    job: Job,
    batch_size: int,
    world_size: int,
    steps: int = PROBE_STEPS,
    model: nn.Module | None = None,
    budget_s: float = PROBE_BUDGET_S,
    batches=None,
) -> Unused:
    """Which trainable parameters got no gradient in ``steps`` forward/backward passes (the
    loss of ``loss()``) on each of the first ``min(world_size, RANKS)`` ranks' batches
    (``data(rank, world_size, batch_size)``, step by step, as the ranks would draw them;
    ``batches``: another such ``(rank, world_size, batch_size) -> iterator``, e.g. one moving
    them to a device), and whether they differed between the ranks of one step
    (:class:`Unused`). Runs on ``model`` (as built with seed 0, e.g. by ``job.check_job``: its
    gradients are cleared and its ``sparse=`` flags restored after) or a model built here
    with seed 0 on the CPU; the caller's torch RNG state is restored. Embedding tables take
    sparse gradients here (cheap for large tables; which rows does not matter). No optimizer
    step. Stops after 2 steps once ``budget_s`` seconds have passed (a model that takes
    seconds a step). Raises JobError when the user's code does."""
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
        draw = batches or job.batches
        streams = [draw(r, world_size, batch_size) for r in range(min(max(world_size, 1), RANKS))]
        unused: set[str] = set()
        by_rank = False
        for i in range(steps):
            if i >= 2 and time.perf_counter() - t0 > budget_s:
                break
            seen = []
            for stream in streams:
                inputs, targets = next(stream)
                model.zero_grad(set_to_none=True)
                loss = job.compute_loss(call_user(job, "the model's forward", call_model, model, inputs), targets)
                call_user(job, "the backward pass", loss.backward)
                seen.append(missing_gradients(model))
            unused = unused.union(*seen)
            by_rank = by_rank or any(s != seen[0] for s in seen)
        return Unused(tuple(sorted(unused)), by_rank)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(training)
        for m, flag in zip(tables, flags):
            m.sparse = flag
        torch.set_rng_state(rng)
