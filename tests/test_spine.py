"""The training spine (strategies/runtimes/spine.py) with a toy step object, in one process and
without torch.distributed: the order of its calls (resume, begin, steps, checkpoints and
evaluations at their steps, in the step object's order, the final write, the result), the
step a resume starts from, the meter's figures and an early last step."""

from __future__ import annotations

import math

from hpar.strategies.job.config import RunConfig
from hpar.strategies.job.context import WorkerContext
from hpar.strategies.runtimes import spine
from hpar.strategies.runtimes.spine import StepOutcome, TrainStep

import torch


class Toy(TrainStep):
    """Records every call of the spine; step s has loss s + 1."""

    def __init__(self, ctx, start=0, first=False, stop_at=None):
        super().__init__(ctx)
        self.calls, self.start, self.checkpoint_first, self.stop_at = [], start, first, stop_at
        self.samples_per_step = 4

    def resume(self):
        self.calls.append("resume")
        return self.start

    def begin(self):
        self.calls.append(("begin", self.ctx.start_step))

    def step(self, step):
        self.calls.append(("step", step))
        return StepOutcome(
            float(step + 1), sent=10, recv=20, lr=0.5, stepped=step != 1, extra={"own": step}, last=step == self.stop_at
        )

    def save(self, n):
        self.calls.append(("save", n))

    def model_copy(self, n):
        self.calls.append(("copy", n))
        return torch.nn.Linear(1, 1)

    def after_step(self, n):
        self.calls.append(("after", n))

    def write_final(self):
        self.calls.append("final")

    def result(self, meter):
        self.calls.append("result")
        return meter.result(None)


class _Job:
    def run_evaluate(self, model):
        return {"acc": 1.0}


def _ctx(**cfg):
    reports, evals = [], []
    config = RunConfig(
        script="x",
        strategy="allreduce",
        world_size=1,
        steps=6,
        batch_size=4,
        lr=0.1,
        seed=0,
        run_dir="r",
        log_every=1,
        **cfg,
    )
    ctx = WorkerContext(
        job=_Job(),
        cfg=config,
        rank=0,
        world_size=1,
        local_rank=0,
        device=torch.device("cpu"),
        report=reports.append,
        report_eval=evals.append,
    )
    return ctx, reports, evals


def test_steps_checkpoints_and_evaluations_come_in_order():
    ctx, reports, evals = _ctx(checkpoint_every=2, eval_every=3)
    toy = Toy(ctx)
    result = spine.train(ctx, toy)
    steps = [c for c in toy.calls if c[0] in ("step", "save", "copy", "after")]
    assert toy.calls[:2] == ["resume", ("begin", 0)] and toy.calls[-2:] == ["final", "result"]
    assert steps == [
        ("step", 0),
        ("after", 1),
        ("step", 1),
        ("save", 2),
        ("after", 2),
        ("step", 2),
        ("copy", 3),
        ("after", 3),  # evaluated, not after the last step
        ("step", 3),
        ("save", 4),
        ("after", 4),
        ("step", 4),
        ("after", 5),
        ("step", 5),
        ("save", 6),
        ("after", 6),
    ]
    assert evals == [{"step": 3, "acc": 1.0}]
    assert [r["step"] for r in reports] == [1, 2, 3, 4, 5, 6]
    assert reports[0]["lr"] == 0.5 and reports[0]["own"] == 0 and reports[1]["skipped_step"] == 1
    assert "skipped_step" not in reports[0] and reports[0]["bytes_sent"] == 10 and reports[0]["bytes_recv"] == 20
    assert (result.loss_first, result.loss_last) == (1.0, 6.0)


def test_checkpoint_first_saves_before_evaluating():
    ctx, _, _ = _ctx(checkpoint_every=2, eval_every=2)
    toy = Toy(ctx, first=True)
    spine.train(ctx, toy)
    assert toy.calls[toy.calls.index(("step", 1)) + 1 :][:3] == [("save", 2), ("copy", 2), ("after", 2)]
    plain = Toy(_ctx(checkpoint_every=2, eval_every=2)[0])
    spine.train(plain.ctx, plain)
    assert plain.calls[plain.calls.index(("step", 1)) + 1 :][:3] == [("copy", 2), ("save", 2), ("after", 2)]


def test_resume_starts_at_the_checkpoint_and_a_finished_run_still_writes():
    ctx, reports, _ = _ctx()
    toy = Toy(ctx, start=4)
    spine.train(ctx, toy)
    assert [c for c in toy.calls if c[0] == "step"] == [("step", 4), ("step", 5)]
    assert ("begin", 4) in toy.calls and [r["step"] for r in reports] == [5, 6]
    done, _, _ = _ctx()
    finished = Toy(done, start=6)
    result = spine.train(done, finished)
    assert finished.calls == ["resume", ("begin", 6), "final", "result"]
    assert math.isnan(result.loss_first) and math.isnan(result.loss_last)


def test_a_last_step_ends_the_loop():
    ctx, _, _ = _ctx()
    toy = Toy(ctx, stop_at=2)
    spine.train(ctx, toy)
    assert [c for c in toy.calls if c[0] == "step"] == [("step", 0), ("step", 1), ("step", 2)]
    assert toy.calls[-2:] == ["final", "result"]
