"""The parts of a training step that every runtime shares: mixed precision, the gradient
scaler, global-norm clipping, the learning-rate schedule, evaluation during training and the
script's own per-step metrics.

One optimizer step of a data-parallel worker under ``--accumulate A``::

    for each of A micro-steps:                   # DDP's no_sync() on all but the last
        with tools.autocast():                   # bf16 / fp16 forward (and backward)
            loss = loss(model(inputs), targets) / A   # model(**inputs) for a dict of its forward's names (forward.py)
        tools.backward(loss)                     # GradScaler.scale(loss).backward() for fp16
    tools.step(opt, params)                      # unscale, clip, step (skipped on inf/NaN), schedule

Dividing each micro-step's mean loss by A makes the accumulated gradient the gradient of the
mean loss over the A batches, so N workers x A micro-steps equal one process on the
concatenation of all N*A batches (DDP averages over the N workers).

Sources: torch.autocast and torch.amp.GradScaler (PyTorch's "Automatic Mixed Precision"
recipe: unscale before clipping, ``scaler.step`` skips the step when any gradient is inf/NaN);
``torch.nn.utils.clip_grad_norm_`` (the global 2-norm over all gradients, as on one process).
Master weights and optimizer state stay in fp32: autocast only changes the dtype of the
operations' outputs inside the forward.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hpar.strategies.common import activity
from hpar.strategies.job.config import RunConfig
from hpar.strategies.job.contract import Job, JobError
from hpar.strategies.job.forward import call_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepTools:
    """The configured precision, scaler, clipping and schedule of one worker's optimizer.

    ``scheduler`` is the script's ``scheduler(optimizer)`` result or None. ``scaler`` is a
    ``torch.amp.GradScaler`` that is enabled only for ``--precision fp16``."""

    cfg: RunConfig
    device: torch.device
    scaler: torch.amp.GradScaler
    scheduler: Any
    last_norm: float | None = None  # total gradient norm before clipping, when clipping

    def autocast(self):
        """Context for forward passes (:func:`autocast`)."""
        return autocast(self.cfg, self.device.type)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the GradScaler under fp16."""
        self.scaler.scale(loss).backward()

    def step(self, opt: torch.optim.Optimizer, params: Callable[[], list[torch.Tensor]], clip: bool = True) -> bool:
        """Unscale, clip by the global norm of ``params()``' gradients (``--clip-grad-norm``;
        ``clip=False`` when the caller clipped by a norm that spans other processes), step the
        optimizer (the scaler skips it when a gradient is inf/NaN), update the scale and step
        the schedule. Returns whether the optimizer stepped."""
        if self.cfg.clip_grad_norm and clip:
            self.scaler.unscale_(opt)
            self.last_norm = float(clip_grad_norm(params(), self.cfg.clip_grad_norm))
        return self.scaled_step(lambda: self.scaler.step(opt))

    def scaled_step(self, opt_step: Callable[[], None]) -> bool:
        """Run ``opt_step`` (``scaler.step(opt)``, or a stage's update around it), update the
        scale and step the schedule. Returns whether the optimizer stepped: the scaler skips a
        step with an inf/NaN gradient and then lowers the scale (always True without fp16)."""
        before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        opt_step()
        self.scaler.update()
        stepped = before is None or self.scaler.get_scale() >= before
        step_schedule(self.scheduler, stepped)
        return stepped

    def lr(self, opt: torch.optim.Optimizer) -> float:
        """The learning rate of the optimizer's first parameter group (what the next step uses)."""
        return float(opt.param_groups[0]["lr"])

    def state_dict(self) -> dict:
        """Scaler and schedule state, for checkpoints."""
        return {
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])


def worker_batches(ctx, control=None):
    """This data-parallel worker's batches (``data(rank, world_size, batch_size)``), past the
    ``--accumulate`` batches of every step a resumed run already trained: the batches an
    uninterrupted run would draw next. The first is drawn here under the phase deadline
    (strategies/job/first_batch.py) and, with ``control`` (the workers' gloo group), its size is
    checked against every peer's before any step (a collective: every worker calls it)."""
    import itertools
    from hpar.strategies.job.first_batch import check_first_batch, first_batch

    drawn = ctx.job.batches(ctx.rank, ctx.world_size, ctx.cfg.batch_size)
    if ctx.start_step >= ctx.cfg.steps:
        return drawn
    first = first_batch(lambda i: next(drawn), ctx.start_step * ctx.cfg.accumulate)
    if control is not None:
        check_first_batch(ctx, first[0], control)  # equal sizes on every worker, before any step
    return itertools.chain([first], drawn)


def micro_steps(ctx, model, batches, tools: StepTools, step: int, around=None):
    """The ``--accumulate`` micro-steps of data-parallel optimizer step ``step`` (0-based), as
    the module docstring writes them: each draws this worker's batch from ``batches``, moves it
    to the worker's device, runs ``model`` and the loss (divided by A) under autocast and the
    backward, inside ``around(last)`` where given (DDP's ``no_sync`` on all but the last
    micro-step); rank 0 runs the script's ``log()`` on the last. Returns (the step's loss, the
    logged metrics, the step's samples: the first micro-batch's times A)."""
    from hpar.strategies.job.context import batch_samples, move_to

    cfg, job = ctx.cfg, ctx.job
    step_loss, logged, samples = 0.0, {}, 0
    for micro in range(cfg.accumulate):
        inputs, targets = next(batches)
        if micro == 0:
            samples = batch_samples(inputs) * cfg.accumulate
        inputs, targets = move_to(inputs, ctx.device), move_to(targets, ctx.device)
        last = micro == cfg.accumulate - 1
        with around(last) if around is not None else contextlib.nullcontext():
            with tools.autocast():
                output = call_model(model, inputs)
                loss = job.compute_loss(output, targets) / cfg.accumulate
            tools.backward(loss)
        step_loss += loss.item()
        if ctx.rank == 0 and last:
            logged = job.run_log(step + 1, output, targets)
    return step_loss, logged, samples


def step_schedule(scheduler, stepped: bool) -> None:
    """``scheduler.step()`` (nothing when ``scheduler`` is None), once per training step
    whether or not the GradScaler skipped the optimizer step, as torch's mixed-precision recipe
    does and every hpar runtime (and the servers' replay of the schedule) does alike. When the
    very first step was skipped, torch warns that ``lr_scheduler.step()`` came before
    ``optimizer.step()`` (it only sees that the optimizer never stepped); that warning is
    silenced for skipped steps only, where it is a false alarm."""
    if scheduler is None:
        return
    with warnings.catch_warnings():
        if not stepped:
            warnings.filterwarnings(
                "ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before", category=UserWarning
            )
        scheduler.step()


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm over all gradients, each multiplied by
    min(1, max_norm / (norm + 1e-6))) that also takes sparse COO gradients, which torch's
    raises on (an ``nn.Embedding(sparse=True)`` under ``allreduce-sparse``). A sparse gradient
    is coalesced first (rows gathered from several workers summed), so its norm is that of the
    dense gradient it stands for and the result equals one process's. Returns the total norm
    before clipping (0-dim tensor)."""
    params = [p for p in params if p.grad is not None]
    sparse = [p for p in params if p.grad.is_sparse]
    if not sparse:
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return total.full_tensor() if hasattr(total, "full_tensor") else total  # FSDP's shards: a DTensor
    for p in sparse:
        p.grad = p.grad.coalesce()
    dense = [p.grad for p in params if not p.grad.is_sparse]
    parts = [torch.linalg.vector_norm(g) for g in dense] + [torch.linalg.vector_norm(p.grad.values()) for p in sparse]
    device = parts[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in parts]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in dense:
        g.mul_(coef.to(g.device))
    for p in sparse:
        p.grad = p.grad * coef.to(p.grad.device)
    return total


def precision_context(precision: str, device_type: str):
    """A factory of the forward's context for ``precision``: ``torch.autocast`` with bf16 or
    fp16 on ``device_type``, nothing for fp32: what :func:`autocast` enters for a run, and what
    the profiler times forward passes under.
    Raises ValueError naming ``--precision`` for another value."""
    if precision == "fp32":
        return contextlib.nullcontext
    if precision not in DTYPES:
        raise ValueError(f"--precision {precision!r}: choose one of fp32, {', '.join(DTYPES)}")
    return lambda: torch.autocast(device_type, dtype=DTYPES[precision])


def autocast(cfg: RunConfig, device_type: str):
    """Context for forward passes: ``torch.autocast`` on ``device_type`` ("cpu", "cuda") with
    the run's dtype, or nothing for fp32."""
    return precision_context(cfg.precision, device_type)()


def step_tools(cfg: RunConfig, job: Job, opt: torch.optim.Optimizer | None, device: torch.device) -> StepTools:
    """StepTools for ``opt``: the script's schedule on it (none when ``opt`` is None, e.g. a
    worker whose every parameter is on the servers), a GradScaler for fp16 on ``device``'s
    type. Raises JobError when ``scheduler()`` fails or returns something else."""
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    return StepTools(cfg, device, scaler, job.build_scheduler(opt) if opt is not None else None)


def evaluate_now(cfg: RunConfig, step: int) -> bool:
    """Whether ``evaluate`` runs after optimizer step ``step`` (1-based) during training:
    every ``--eval-every`` steps, except the last (the worker evaluates the final model)."""
    return bool(cfg.eval and cfg.eval_every) and step % cfg.eval_every == 0 and step < cfg.steps


def evaluate_during_training(
    job: Job,
    cfg: RunConfig,
    rank: int,
    step: int,
    model: Callable[[], torch.nn.Module],
    report_eval: Callable[[dict], None],
) -> dict:
    """Run ``evaluate(model())`` on worker rank 0 after step ``step`` when ``--eval-every``
    asks for it and report ``{"step": step, **metrics}``; the other ranks go on and meet rank 0
    at the next collective (evaluate must finish within the process group's timeout, 300 s by
    default, HPAR_PG_TIMEOUT), and within the launcher's phase deadline (strategies/common/activity.py:
    the model copy, which under hybrid/ps pulls every served row, included). Runs under a forked
    RNG, so evaluating does not change the random numbers training draws next. Returns the
    metrics ({} when nothing ran)."""
    if rank != 0 or not evaluate_now(cfg, step):
        return {}
    with torch.random.fork_rng(devices=[]), activity.doing(f"in evaluate() after step {step}"):
        metrics = job.run_evaluate(model())
    report_eval({"step": step, **metrics})
    return metrics


def check_precision(job: Job, cfg: RunConfig, model: torch.nn.Module) -> None:
    """Dry run of one forward pass and the loss under the run's autocast on the CPU, before any
    process starts (only for CPU runs: a CUDA worker's kernels differ). Raises JobError naming
    ``--precision`` when the script's model cannot run at that precision here."""
    if cfg.precision == "fp32" or cfg.device != "cpu":
        return
    inputs, targets = next(job.batches(0, 1, cfg.batch_size))
    try:
        with autocast(cfg, "cpu"):
            job.compute_loss(call_model(model, inputs), targets)
    except Exception as exc:
        raise JobError(
            f"{job.path}: the forward pass fails under --precision {cfg.precision} on CPU "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "use --precision fp32, or keep that layer in fp32 with torch.autocast(..., enabled=False)"
        ) from exc


def clip_coefficient(total_sq: float, max_norm: float) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` scales every gradient by, from the sum of
    squares of all gradients: ``min(1, max_norm / (sqrt(total_sq) + 1e-6))``. For norms that
    span processes (parameter servers, pipeline stages), whose parts are summed first."""
    return min(1.0, max_norm / (math.sqrt(total_sq) + 1e-6))
