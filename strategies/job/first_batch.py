"""A worker's first batch: drawn within the launcher's phase deadline, and checked before
the first step.

Every runtime draws its batches from the user's ``data()`` (``job.batches``); the first draw
is where a data loader that never delivers (a dead file system, a tokenizer server that does
not answer, a queue nobody fills) shows, before any step could be counted. The batches a
resumed run skips (those the run trained on before its checkpoint, so that it sees the same
data as an uninterrupted run) and then the first batch it trains on are drawn under
``activity.doing`` (strategies/common/activity.py): a worker that gets no batch within
``--phase-timeout`` is named with what it was doing and its stack, instead of leaving its
peers waiting in their first collective under the start-up bound.

Then the batch is checked, before it trains anything, for what would break hpar's exactness
guarantee (N workers equal one process on the concatenated batch, DESIGN.md): data-parallel
workers (and a pipeline's replicas) whose first batches differ in size, since DDP averages each
worker's *mean* gradient, so a sample of a 7-sample batch would weigh 8/7 as much as one of an
8-sample batch; and a pipeline's batch that its micro-batches do not divide. The sizes are
gathered over the workers' gloo control group (one small collective per run); a refusal is one
line naming the ranks and sizes (:class:`BatchRefused`, and a ``refused`` event that the
launcher prints instead of a crash report, exit 2), unless ``--allow-unequal-batches`` lets
unequal sizes train (the launcher then warns once: launcher/run/batchcheck.py).
"""

from __future__ import annotations

from typing import Any, Callable

from hpar.strategies.common import activity
from hpar.strategies.job.context import WorkerContext, batch_samples
from hpar.strategies.common.gather import all_gather_ints
from hpar.strategies.job.contract import JobError

SKIPPING = "in data(), skipping the batches the run trained on before its checkpoint"
DRAWING = "in data(), drawing its first batch"


def first_batch(draw: Callable[[int], Any], skip: int = 0) -> Any:
    """Draw batches ``0 .. skip-1`` of the run with ``draw(i)`` and drop them (each within the
    deadline, not their sum), then return batch ``skip``, the first to train on."""
    if skip:
        with activity.doing(SKIPPING):
            for i in range(skip):
                draw(i)
                activity.tick()
    with activity.doing(DRAWING):
        return draw(skip)


class BatchRefused(JobError):
    """A first batch that would break exactness: the message is the launcher's one line, sent
    in a ``refused`` event, so the worker does not print it again (workers/worker.run_entry)."""

    announced = True


def sizes_text(sizes: dict[int, int], who: str = "worker") -> str:
    """``worker 0: 8, worker 1: 7`` for ``{rank: samples}``."""
    return ", ".join(f"{who} {r}: {n}" for r, n in sorted(sizes.items()))


def unequal_message(sizes: dict[int, int], batch_size: int, who: str = "worker") -> str:
    """The refusal of first batches of different sizes (``{rank: samples}``), one line."""
    return (
        f"{who}s' first batches differ in size ({sizes_text(sizes, who)} samples): gradients are averaged per "
        f"{who}, so this is not one process on the concatenated batch; make data(rank, world_size, batch_size) "
        f"yield {batch_size} samples on every rank, or pass --allow-unequal-batches to train so (each {who}'s "
        "mean gradient weighs the same, as DDP does)"
    )


def refuse(ctx: WorkerContext, message: str, announce: bool = True) -> None:
    """Raise BatchRefused(``message``); with ``announce``, the launcher hears it first (one
    ``refused`` event: it prints the line and exits 2)."""
    if announce and ctx.event is not None:
        ctx.event({"kind": "refused", "message": message})
    raise BatchRefused(message)


def _samples(inputs: Any) -> int | None:
    """The batch's samples (strategies/context.batch_samples), None for no batch or one whose
    samples cannot be counted (a pipeline's first stage takes any object; nothing to check)."""
    try:
        return None if inputs is None else batch_samples(inputs)
    except ValueError:
        return None


def check_first_batch(
    ctx: WorkerContext, inputs: Any, group, micro_batches: int = 1, replica: int | None = None
) -> None:
    """Check this worker's first batch (``inputs``; None on a pipeline stage that draws none)
    against the others' before the first step. ``group``: the workers' gloo control group, every
    worker calls this (a collective), so that all of them refuse together; ``micro_batches``: a
    pipeline's M, which must divide every batch; ``replica``: a pipeline stage's replica (its
    first stage's size is the replica's). Raises BatchRefused naming ranks and sizes (see the
    module docstring); worker 0 announces it."""
    cfg = ctx.cfg
    samples = _samples(inputs)
    mine = (ctx.rank, replica if replica is not None else ctx.rank, -1 if samples is None else samples)
    if ctx.world_size > 1:  # int64 tensors, never pickles (strategies/common/gather.py); -1: no count
        everyone = [tuple(v) for v in all_gather_ints(mine, group=group)]
    else:
        everyone = [mine]
    everyone = [(rank, who, None if n < 0 else n) for rank, who, n in everyone]
    drawn = [(rank, who, n) for rank, who, n in everyone if n is not None]
    indivisible = {rank: n for rank, _, n in drawn if n % micro_batches}
    if indivisible:
        refuse(
            ctx,
            f"first batches that --micro-batches {micro_batches} does not divide ({sizes_text(indivisible)} "
            f"samples): make data() yield --batch-size ({cfg.batch_size}) samples, or choose --micro-batches "
            "that divides them",
            announce=ctx.rank == 0,
        )
    sizes = {who: n for _, who, n in drawn}
    if len(set(sizes.values())) > 1 and not cfg.allow_unequal_batches:
        refuse(
            ctx,
            unequal_message(sizes, cfg.batch_size, "worker" if replica is None else "replica"),
            announce=ctx.rank == 0,
        )
