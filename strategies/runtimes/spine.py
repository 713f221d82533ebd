"""The one training loop every runtime runs: what all strategies share, with what differs
plugged in as a step object.

A runtime's ``train(ctx)`` builds its step object and hands it to :func:`train`, which reads
top to bottom as one run does (nanoGPT's loop, torchtitan's ``train_step``)::

    ctx.start_step = step.resume()          # 0, or the step of the checkpoint a --resume loads
    step.begin()                            # batches past the trained ones, hooks, a first evaluate()
    meter = StepMeter(ctx, step.samples_per_step)
    for s in range(ctx.start_step, cfg.steps):
        meter.start()                       # unless step.restart_timer is False (pipelines)
        out = step.step(s)                  # one optimizer step: micro-steps, exchange, update
        meter.end(out.loss, out.sent, out.recv, ...)   # timing, bytes, lr, skipped step, log()'s metrics
        if step.checkpoint_first:           # hybrid/ps, pipeline: checkpoint, then evaluate
            checkpoint(s + 1); evaluate(s + 1)
        else:                               # allreduce, fsdp: evaluate, then checkpoint
            evaluate(s + 1); checkpoint(s + 1)
        step.after_step(s + 1)
        if out.last: break                  # the pipeline's divergence guard stopped the run
    step.write_final()                      # the trained model where it lives (RUN_DIR/model)
    first, last = mean over the workers of the first and last losses (step.loss_groups)
    return step.result(meter)               # the TrainResult with the strategy's own extras

``checkpoint(n)`` is ``step.save(n)`` every ``--checkpoint-every`` steps and ``evaluate(n)`` is
``step.evaluate(n)`` every ``--eval-every`` steps except the last (loop.evaluate_now). A step
object is a :class:`TrainStep` subclass: it must define :meth:`TrainStep.step` and overrides the
other methods where its strategy differs; it keeps its per-step state as attributes and runs its
own ``--accumulate`` micro-steps inside ``step()`` (loop.micro_steps for DDP and FSDP). Steps are counted from 0 inside the loop; the
hooks after a step get the number of steps done (``s + 1``), as checkpoints count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hpar.strategies.common import measured_memory as memory
from hpar.strategies.job.context import StepMeter, TrainResult, WorkerContext
from hpar.strategies.common.groups import mean_over_workers
from hpar.strategies.job.loop import evaluate_during_training, evaluate_now


@dataclass
class StepOutcome:
    """What one optimizer step reports. ``loss``: this process's training loss of the step
    (the mean over its micro-steps; NaN on a pipeline stage without the loss); ``sent``/``recv``:
    bytes this process exchanged for the step; ``sent_remote``: the part of ``sent`` addressed
    to other hosts (None: not counted); ``logged``: the script's ``log()`` metrics (worker rank
    0); ``lr``: the learning rate the step used (None: no optimizer here); ``grad_norm``: the
    gradient norm before clipping, when reported; ``stepped``: False when the fp16 scaler
    skipped the step; ``extra``: the strategy's own per-step figures (StepMeter's ``extra``,
    before ``lr``/``grad_norm``/``skipped_step``); ``samples``: this process's samples of the
    step (None: keep the meter's); ``last``: no step follows this one, whatever ``--steps``
    says (the pipeline's ``--on-divergence stop``)."""

    loss: float
    sent: float = 0
    recv: float = 0
    sent_remote: float | None = None
    logged: dict | None = None
    lr: float | None = None
    grad_norm: float | None = None
    stepped: bool = True
    extra: dict = field(default_factory=dict)
    samples: int | None = None
    last: bool = False

    def figures(self) -> dict:
        """The meter's ``extra`` for this step: the strategy's figures, then ``lr``,
        ``grad_norm`` and ``skipped_step`` where they apply."""
        return {
            **self.extra,
            **({"lr": self.lr} if self.lr is not None else {}),
            **({"grad_norm": float(self.grad_norm)} if self.grad_norm is not None else {}),
            **({} if self.stepped else {"skipped_step": 1}),
        }


class TrainStep:
    """A strategy's part of the loop (module docstring). ``ctx`` is the worker's context;
    ``checkpoint_first``: whether a step's checkpoint comes before its evaluation (hybrid/ps,
    whose servers wait in the checkpoint's commit barrier and could not answer evaluate()'s
    pulls; the pipeline); ``samples_per_step``: the meter's samples per step until a
    StepOutcome says otherwise; ``loss_groups``: the WorkerGroups over whose control group the
    first and last losses are averaged (None: this process's own, as a pipeline stage's);
    ``restart_timer``: whether each step's time starts when the loop reaches it (False: at the
    end of the step before, evaluation and checkpoint included: the pipeline's overlapping
    steps)."""

    checkpoint_first = False
    restart_timer = True

    def __init__(self, ctx: WorkerContext):
        self.ctx, self.cfg, self.job = ctx, ctx.cfg, ctx.job
        self.samples_per_step = 0
        self.loss_groups = None

    def resume(self) -> int:
        """Load the run's latest checkpoint when ``--resume`` asks for it; returns the step to
        start from (0 when nothing was loaded)."""
        return 0

    def begin(self) -> None:
        """Everything between the resume and the first step (``ctx.start_step`` is set)."""

    def step(self, step: int) -> StepOutcome:
        """Run optimizer step ``step`` (0-based) and report it."""
        raise NotImplementedError

    def save(self, steps_done: int) -> None:
        """Write checkpoint ``steps_done`` (a collective where the state is spread)."""

    def model_copy(self, steps_done: int) -> torch.nn.Module:
        """Worker rank 0: the model after ``steps_done`` steps, for ``evaluate()``."""
        raise NotImplementedError

    def evaluate(self, steps_done: int) -> None:
        """``evaluate()`` after ``steps_done`` steps (called on every process when
        ``--eval-every`` asks for it): by default worker rank 0 evaluates :meth:`model_copy`."""
        evaluate_during_training(
            self.job, self.cfg, self.ctx.rank, steps_done, lambda: self.model_copy(steps_done), self.ctx.report_eval
        )

    def after_step(self, steps_done: int) -> None:
        """Called after every step's checkpoint and evaluation."""

    def write_final(self) -> None:
        """Write the trained model where it lives (strategies/state/state.write_final)."""

    def result(self, meter: StepMeter) -> TrainResult:
        """The runtime's TrainResult (its losses are then replaced by the workers' means)."""
        return meter.result(None)


def checkpoint_now(cfg, steps_done: int) -> bool:
    """Whether a checkpoint is written after ``steps_done`` steps: every ``--checkpoint-every``."""
    return bool(cfg.checkpoint_every) and steps_done % cfg.checkpoint_every == 0


def train(ctx: WorkerContext, step: TrainStep) -> TrainResult:
    """Run the loop of the module docstring with ``step``; returns ``step.result(meter)`` with
    ``loss_first``/``loss_last`` averaged over the workers of ``step.loss_groups``."""
    cfg = ctx.cfg
    ctx.start_step = step.resume()
    step.begin()
    meter = StepMeter(ctx, step.samples_per_step)
    meter.start()
    for s in range(ctx.start_step, cfg.steps):
        if step.restart_timer:
            meter.start()
        out = step.step(s)
        if out.samples is not None:
            meter.samples_per_step = out.samples
        meter.end(out.loss, out.sent, out.recv, extra=out.figures(), sent_remote=out.sent_remote, logged=out.logged)
        done = s + 1
        if step.checkpoint_first and checkpoint_now(cfg, done):
            step.save(done)
        if evaluate_now(cfg, done):
            step.evaluate(done)
        if not step.checkpoint_first and checkpoint_now(cfg, done):
            step.save(done)
        step.after_step(done)
        if out.last:
            break
    memory.open_final_window()  # the final write (and worker 0's copy for evaluate()) measured apart
    step.write_final()
    pair = [meter.losses[0], meter.losses[-1]] if meter.losses else [float("nan")] * 2
    if step.loss_groups is not None:
        pair = mean_over_workers(pair, step.loss_groups, ctx.world_size)
    result = step.result(meter)
    if step.loss_groups is not None:
        result.loss_first, result.loss_last = pair
    return result
