"""What a hybrid/ps worker's step (strategies/runtimes/hybrid/worker_step.py) is built from and
the collectives it shares with the servers: the worker's parts (model, served tables, process
groups, PS client, dense optimizer), the DDP hook that averages dense gradients over the worker
group, ``--clip-grad-norm`` by the norm that spans the servers, and when rows are pulled ahead."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from hpar.strategies.job.context import WorkerContext
from hpar.strategies.job.loop import clip_coefficient, evaluate_now
from hpar.strategies.runtimes.dataparallel.allreduce import DENSE, ring_allreduce_bytes
from hpar.strategies.runtimes.hybrid import embedding


class WorkerParts(NamedTuple):
    """What a worker builds before training (strategies/runtimes/hybrid/hybrid_runtime.py ``_setup``): the model
    as ``model()`` returned it (``outer``) and the module inside, the served tables, the
    process groups, the PS client, the step clock, the served embeddings, the (table,
    parameter) pairs pulled whole each step, the dense parameters and their optimizer (None
    when every parameter is on the servers)."""

    outer: torch.nn.Module
    model: torch.nn.Module
    tables: list
    groups: object
    client: object
    clock: embedding.StepClock
    served: list
    whole: list
    dense: list
    opt: torch.optim.Optimizer | None


def group_allreduce_hook(state, bucket):
    """DDP communication hook: mean AllReduce of the bucket over the worker group (the
    default group also holds the servers), counting ring bytes 2(N-1)/N * B per worker.
    ``state``: (ByteMeter, N, the worker group, whether the ring successor is on another host)."""
    counter, world_size, group, remote = state
    buf = bucket.buffer()
    b = ring_allreduce_bytes(buf.numel() * buf.element_size(), world_size)
    counter.add(DENSE, sent=b, recv=b, remote=remote)
    buf.div_(world_size)
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def clip_with_servers(ctx: WorkerContext, dense: list[torch.Tensor]) -> None:
    """``--clip-grad-norm`` under hybrid/ps: one AllReduce over the default group (workers and
    servers, after this worker's DONE) sums the squares of the whole averaged gradient (worker
    0 adds the dense part, identical on every worker after DDP; each server its rows), then
    the dense gradients are scaled by torch's clipping coefficient, as the servers do theirs."""
    sq = sum(float(p.grad.double().pow(2).sum()) for p in dense if p.grad is not None) if ctx.rank == 0 else 0.0
    total = torch.tensor([sq], dtype=torch.float64)
    dist.all_reduce(total)
    coef = clip_coefficient(float(total), ctx.cfg.clip_grad_norm)
    for p in dense:
        if p.grad is not None:
            p.grad.mul_(coef)


def pull_ahead(cfg, step: int, caches=None) -> bool:
    """Whether step ``step``'s rows may be requested during the step before (PullAhead):
    not past the last step, not for a step after which rank 0 pulls whole tables for
    evaluation (its answers would share the reply tags), not for a step that starts a hot-row
    cache epoch (its pulls follow the epoch's CACHE requests), and not with ``pull_ahead``
    False in the plan (``"pull_ahead": false`` in a plan file, for A/B measurements)."""
    return (
        step < cfg.steps
        and not evaluate_now(cfg, step)
        and cfg.plan.pull_ahead
        and not (caches and caches.boundary(step))
    )
