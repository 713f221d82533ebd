"""Per-stage orders of forward and backward passes for the pipeline schedules.

A schedule is, for every stage k of K, the sequence of operations it runs: ``F j`` (forward
of micro-batch j) and ``B j`` (its backward). ``strategies/runtimes/pipeline/pipeline_runtime.py`` executes the
sequence; the order alone fixes which weights every pass sees, so the version distances of
weight prediction are derived here from the same sequence.

Schedules (``--schedule``):

- ``gpipe`` (Huang et al., "GPipe", NeurIPS 2019): all M forwards, then all M backwards,
  then one optimizer step (flush). Synchronous.
- ``1f1b`` (synchronous 1F1B with flush, as in PipeDream-Flush / Megatron-LM, Narayanan et
  al. SC 2021): stage k runs ``w = min(K-1-k, M)`` warm-up forwards, then alternates one
  forward and one backward, then drains the remaining backwards; one optimizer step per
  batch. Both synchronous schedules equal single-process gradient accumulation.
- ``async``, ``async-stash``, ``async-predict`` (PipeDream, Narayanan et al., SOSP 2019): the
  same 1F1B order over the endless stream of micro-batches of the whole run, without flush;
  every stage updates its weights right after each backward. They differ only in the weights
  a pass uses (``strategies/runtimes/pipeline/prediction.py``).
- ``async-2bw`` (PipeDream-2BW, Narayanan et al., ICML 2021): the same endless 1F1B order,
  but a stage applies the accumulated gradient of a batch once, after the backward of the
  batch's last micro-batch, and batch b runs on the weights one update old (double
  buffering); needs M >= K-1 micro-batches per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

SYNC_SCHEDULES = ("gpipe", "1f1b")
ASYNC_SCHEDULES = ("async", "async-stash", "async-predict", "async-2bw")


@dataclass(frozen=True)
class Op:
    """One pass at one stage. ``kind``: "F" (forward) or "B" (backward); ``micro``: the
    micro-batch index (within the step for synchronous schedules, within the run for
    asynchronous ones); ``distance``: the version distance s, the number of weight updates
    this stage makes between this pass and the update made with this micro-batch's own
    gradient (0 in synchronous schedules: every pass of a step sees the same weights)."""

    kind: str
    micro: int
    distance: int = 0


def is_synchronous(schedule: str) -> bool:
    """True for the flushing schedules (gpipe, 1f1b), False for the asynchronous ones.
    Raises ValueError naming ``--schedule`` for other names."""
    if schedule in SYNC_SCHEDULES:
        return True
    if schedule in ASYNC_SCHEDULES:
        return False
    raise ValueError(f"--schedule {schedule!r}: hpar's pipeline runs {', '.join(SYNC_SCHEDULES + ASYNC_SCHEDULES)}")


def one_f_one_b(num_stages: int, stage: int, num_micro: int) -> list[tuple[str, int]]:
    """The 1F1B order at ``stage`` (0-based) for micro-batches ``0..num_micro-1``:
    warm-up of ``w = min(K-1-k, N)`` forwards, steady pairs ``F w+i, B i``, then cool-down
    backwards. Stage k thus has at most K-k micro-batches in flight."""
    _check(num_stages, stage, num_micro)
    w = min(num_stages - 1 - stage, num_micro)
    ops = [("F", j) for j in range(w)]
    for i in range(num_micro - w):
        ops += [("F", w + i), ("B", i)]
    ops += [("B", j) for j in range(num_micro - w, num_micro)]
    return ops


def gpipe(num_stages: int, stage: int, num_micro: int) -> list[tuple[str, int]]:
    """GPipe's order: all forwards, then all backwards (same order)."""
    _check(num_stages, stage, num_micro)
    return [("F", j) for j in range(num_micro)] + [("B", j) for j in range(num_micro)]


def with_distances(order: list[tuple[str, int]], update_every_backward: bool) -> tuple[Op, ...]:
    """Attach the version distance s to each pass of one stage's order.

    With an update after every backward (asynchronous schedules), micro-batch j's own update
    is this stage's (j+1)-th, so under sequential SGD its passes would see the weights after
    j updates; a pass preceded by u updates sees a version s = j - u behind that. On the
    1F1B order this gives s = min(j, K-1-k) for forwards and 0 for backwards (SpecTrain,
    Chen, Yang, Cheng, arXiv 1809.02839, derived here for PipeDream's order instead of the
    paper's). Without per-backward updates every distance is 0.
    """
    ops, updates = [], 0
    for kind, j in order:
        s = j - updates if update_every_backward else 0
        assert s >= 0, "a pass cannot run after its own micro-batch's update"
        ops.append(Op(kind, j, s))
        if kind == "B" and update_every_backward:
            updates += 1
    return tuple(ops)


def stage_ops(schedule: str, num_stages: int, stage: int, num_micro: int) -> tuple[Op, ...]:
    """The operations of ``stage`` under ``schedule``: for gpipe/1f1b the ``num_micro``
    micro-batches of one step (repeated every step); for the asynchronous schedules the
    ``num_micro`` micro-batches of the whole run (steps x micro-batches per step).
    Raises ValueError for an unknown schedule or bad counts."""
    sync = is_synchronous(schedule) or schedule == "async-2bw"
    order = gpipe(num_stages, stage, num_micro) if schedule == "gpipe" else one_f_one_b(num_stages, stage, num_micro)
    return with_distances(order, update_every_backward=not sync)


def updates_after(schedule: str, micro: int, num_micro: int) -> bool:
    """Whether a stage steps its optimizer right after the backward of (run-global)
    micro-batch ``micro``: after every one in async/async-stash/async-predict, after the
    last of each batch of ``num_micro`` in async-2bw, never for gpipe/1f1b (they step at
    the end of the batch, outside the pass order)."""
    if is_synchronous(schedule):
        return False
    return schedule != "async-2bw" or (micro + 1) % num_micro == 0


def micro_batch_count(target: int, batch_size: int, at_least: int = 1) -> int:
    """The micro-batches per batch nearest ``target`` that divide ``batch_size`` (the runtime
    cuts a batch into equal micro-batches, stage.split_micro), taken among the divisors of at
    least ``at_least`` where there is one: the stages K, so that each stage has a micro-batch
    in flight and the bubble stays (K-1)/(M+K-1) at most half; ties go to the larger count
    (the smaller bubble). E.g. 3 stages and a batch of 32: target 3 gives 4, 6 gives 8."""
    assert batch_size >= 1 and target >= 1
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    pool = [d for d in divisors if d >= at_least] or divisors
    return min(pool, key=lambda d: (abs(d - target), -d))


def execution_order(per_stage: list[tuple[Op, ...]]) -> list[list[tuple[int, Op]]]:
    """Replay the stages' orders in unit time ticks: at each tick every stage runs its next
    pass if its inputs are ready (F j at stage k needs F j of stage k-1 from an earlier
    tick; B j needs B j of stage k+1 and F j at k). Returns the list of ticks, each a list of
    ``(stage, op)``. Raises ValueError if the orders deadlock. Used by the single-process
    simulator and to check schedules (a synchronous 1F1B step takes 2(M+K-1) ticks)."""
    num_stages = len(per_stage)
    pos = [0] * num_stages
    done: set[tuple[int, str, int]] = set()
    ticks = []
    while any(pos[k] < len(per_stage[k]) for k in range(num_stages)):
        tick = []
        for k in range(num_stages):
            if pos[k] == len(per_stage[k]):
                continue
            op = per_stage[k][pos[k]]
            if op.kind == "F":
                ready = k == 0 or (k - 1, "F", op.micro) in done
            else:
                ready = (k, "F", op.micro) in done and (k == num_stages - 1 or (k + 1, "B", op.micro) in done)
            if ready:
                tick.append((k, op))
        if not tick:
            raise ValueError("pipeline schedule deadlocks: no stage can make progress")
        for k, op in tick:
            done.add((k, op.kind, op.micro))
            pos[k] += 1
        ticks.append(tick)
    return ticks


def bubble_fraction(num_stages: int, num_micro: int) -> float:
    """Idle fraction of a synchronous pipeline step with equal stages: (K-1)/(M+K-1)
    (GPipe, Huang et al. 2019)."""
    return (num_stages - 1) / (num_micro + num_stages - 1)


def _check(num_stages: int, stage: int, num_micro: int) -> None:
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} pipeline stages (--gpus)")
    if num_micro < 1:
        raise ValueError(f"--micro-batches must be at least 1, got {num_micro}")
