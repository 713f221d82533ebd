"""Single-process pipeline simulator: K stages in one process, replaying a schedule.

Each stage's weights depend only on the order of its own passes, so running the stages'
operation lists (``schedules.stage_ops``) one tick at a time in one process
(``schedules.execution_order``) gives the same numbers as K processes, without any process
group. It uses the runtime's :class:`~hpar.strategies.runtimes.pipeline.stage.Stage` (forward, backward,
weight stashing, SpecTrain prediction), so it tests that code, and it makes staleness
experiments with many stages cheap and deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpar.strategies.job.contract import Job
from hpar.strategies.plan.schedules import execution_order, is_synchronous, stage_ops, updates_after
from hpar.strategies.specs.pipeline_spec import check_2bw
from hpar.strategies.job.layers import is_declared_sequence
from hpar.strategies.runtimes.pipeline.stage import Stage, build_stages_model, stage_module
from hpar.strategies.plan.stage_cuts import example_micro_batch, split_micro, stage_ranges
from hpar.strategies.plan.stage_cuts import sequential_layers as stage_layers
from hpar.strategies.job.tying import shared_across_stages
from hpar.strategies.plan.stage_cuts import check_schedule
from hpar.strategies.runtimes.pipeline.divergence import GuardConfig, LossWatch, cut_step, report
from hpar.strategies.runtimes.pipeline.prediction import mode_for_schedule


@dataclass(frozen=True)
class SimResult:
    """``model``: the whole trained model; ``losses``: mean loss of each batch (step), in
    step order; ``max_in_flight``: the most micro-batches any stage held at once."""

    model: torch.nn.Module
    losses: tuple[float, ...]
    max_in_flight: int
    divergence: dict | None = None  # the guard's summary.json entry (guard on only)


def simulate(
    job: Job,
    schedule: str,
    num_stages: int,
    steps: int,
    batch_size: int,
    micro_batches: int,
    lr: float,
    seed: int = 0,
    guard: GuardConfig | None = None,
) -> SimResult:
    """Train ``steps`` batches of ``batch_size`` from ``job.batches(0, 1, batch_size)`` with
    ``num_stages`` stages (balanced on parameter counts) under ``schedule`` in this process.
    The model is built with ``torch.manual_seed(seed)`` as the runtime does. ``guard``: the
    divergence guard of asynchronous schedules (strategies/runtimes/pipeline/divergence.py), applied with
    the runtime's rule (asynchronous up to the cut step, then 1f1b or stop). Raises
    ValueError as the runtime does (non-sequential model, bad micro-batch count)."""
    if schedule == "async-2bw":
        check_2bw(num_stages, micro_batches)
    result = _simulate(job, schedule, num_stages, steps, 0, batch_size, micro_batches, lr, seed)
    if guard is None or guard.action == "off" or is_synchronous(schedule):
        return result
    watch = LossWatch(guard)
    tripped = next((s for s, loss in enumerate(result.losses) if watch.observe(s, loss)), None)
    cut = None if tripped is None else cut_step(tripped, num_stages, micro_batches)
    if cut is not None and cut < steps:  # replay: asynchronous up to the cut, then 1f1b or nothing
        rest = steps - cut if guard.action == "sync" else 0
        result = _simulate(job, schedule, num_stages, cut, rest, batch_size, micro_batches, lr, seed)
    return SimResult(result.model, result.losses, result.max_in_flight, report(guard, watch.tripped, cut, steps))


def _simulate(
    job: Job,
    schedule: str,
    num_stages: int,
    steps: int,
    sync_steps: int,
    batch_size: int,
    micro_batches: int,
    lr: float,
    seed: int,
) -> SimResult:
    """``steps`` steps under ``schedule``, then ``sync_steps`` under 1f1b on the same stages."""
    model = build_stages_model(job, seed)
    example = None if is_declared_sequence(model) else example_micro_batch(job, batch_size, micro_batches, seed)
    ranges = stage_ranges(model, num_stages, example=example)
    sync = is_synchronous(schedule)
    mode = mode_for_schedule(schedule)
    check_schedule(shared_across_stages(stage_layers(model, example), ranges), schedule)
    stages, stepped = [], set()  # a weight tied across stages is one tensor here: stepped by its first stage
    for k, (a, b) in enumerate(ranges):
        module = stage_module(model, a, b, example)
        params = [p for p in module.parameters() if id(p) not in stepped and p.requires_grad]
        stepped.update(id(p) for p in params)
        opt = job.build_optimizer(params, lr) if params else None
        stages.append(Stage(job, module, opt, mode, k, num_stages, 1.0 / micro_batches))
    batches = job.batches(0, 1, batch_size)
    inputs, targets = {}, {}

    def draw(step: int, first_micro: int) -> None:
        x, y = next(batches)
        for i, (xm, ym) in enumerate(zip(split_micro(x, micro_batches), split_micro(y, micro_batches))):
            inputs[first_micro + i], targets[first_micro + i] = xm, ym

    losses: list[float] = []
    most = 0

    def run(ticks, offset: int, per_step_losses: dict) -> None:
        nonlocal most
        acts, grads = {}, {}
        for tick in ticks:
            results = []
            for k, op in tick:
                st = stages[k]
                j = op.micro + offset
                if op.kind == "F":
                    if st.is_first and j not in inputs:
                        draw(j // micro_batches, j - j % micro_batches)
                    x = inputs.pop(j) if st.is_first else acts.pop((k, j))
                    out = st.forward(op, x, targets.pop(j) if st.is_last else None)
                    results.append(("F", k, j, out))
                    most = max(most, st.weights.in_flight(), len(st.saved))
                else:
                    g = st.backward(op, None if st.is_last else grads.pop((k, j)))
                    results.append(("B", k, j, g))
                    if updates_after(schedule, j, micro_batches):
                        st.update()
            for kind, k, j, value in results:  # hand over after the tick, as messages would
                if kind == "F" and not stages[k].is_last:
                    acts[(k + 1, j)] = value
                elif kind == "F":
                    per_step_losses.setdefault(j // micro_batches, []).append(value)
                elif k > 0:
                    grads[(k - 1, j)] = value

    step_losses: dict[int, list[float]] = {}
    first_sync = 0
    if not sync:
        n = steps * micro_batches
        run(execution_order([stage_ops(schedule, num_stages, k, n) for k in range(num_stages)]), 0, step_losses)
        first_sync, steps, schedule, sync = steps, steps + sync_steps, "1f1b", True
        for st in stages:
            st.weights.mode = "sync"
    for step in range(first_sync, steps):
        ticks = execution_order([stage_ops(schedule, num_stages, k, micro_batches) for k in range(num_stages)])
        run(ticks, step * micro_batches, step_losses)
        for st in stages:
            st.update()
    losses = [sum(step_losses[s]) / len(step_losses[s]) for s in range(steps)]
    return SimResult(model=model, losses=tuple(losses), max_in_flight=most)
