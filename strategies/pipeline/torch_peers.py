"""The peers of hpar's pipeline: torch.distributed.pipelining's ScheduleGPipe and
Schedule1F1B on the same stages and micro-batches (``--schedule torch-gpipe|torch-1f1b``).

Same stage cut (``stage.stage_ranges``), same seeded initial weights, same batches (first
stage: inputs, last stage: targets, from ``job.batches(0, 1, batch_size)``), same
micro-batch count; torch splits the batch into micro-batches itself, runs the passes and
scales gradients by 1/M (``scale_grads=True``), then every stage takes one optimizer step.
So these runs are the same math as hpar's ``gpipe``/``1f1b`` and differ only in the
runtime, which is what the benchmark compares. Reports the same per-stage figures where
torch exposes them (compute and idle are not separated: ``compute_s`` is the step time).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hpar.strategies.context import StepMeter, TrainResult, WorkerContext, move_to
from hpar.strategies.groups import worker_groups
from hpar.strategies.loop import autocast
from hpar.strategies.pipeline.stage import build_stages_model, describe, stage_module, stage_ranges


def _draw(batches, seed: int, step: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + step)
        return next(batches)


class _ActivationBytes:
    """Bytes of a stage module's input and output tensors since the last :meth:`take`
    (forward hooks), to count what torch.distributed.pipelining sends between stages."""

    def __init__(self, module: torch.nn.Module):
        self.into = self.out = 0
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    @staticmethod
    def _nbytes(x) -> int:
        return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0

    def _pre(self, _module, args) -> None:
        self.into += sum(self._nbytes(a) for a in args)

    def _post(self, _module, _args, output) -> None:
        self.out += self._nbytes(output)

    def take(self) -> tuple[int, int]:
        out = (self.into, self.out)
        self.into = self.out = 0
        return out


class _Autocast(torch.nn.Module):
    """The stage module's forward under the run's ``torch.autocast`` (``--precision bf16``):
    torch's PipelineStage runs the module it is given, so autocast goes inside it; the
    activations it sends are then bf16, as in hpar's own schedules."""

    def __init__(self, module: torch.nn.Module, cfg, device_type: str):
        super().__init__()
        self.inner, self.cfg, self.device_type = module, cfg, device_type

    def forward(self, x):
        with autocast(self.cfg, self.device_type):
            return self.inner(x)


def train(ctx: WorkerContext) -> TrainResult:
    """One torch PipelineStage per process; returns the whole model on rank 0.
    Raises ValueError as hpar's pipeline does (non-sequential model, fewer layers than
    stages, micro-batches that do not divide the batch); checkpoints are not supported."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    cfg, job = ctx.cfg, ctx.job
    if cfg.batch_size % cfg.micro_batches:
        raise ValueError(f"--micro-batches {cfg.micro_batches} does not divide --batch-size {cfg.batch_size}; choose a divisor")
    if cfg.checkpoint_every or cfg.resume:
        raise ValueError(f"--schedule {cfg.schedule}: checkpoints are only supported by hpar's own schedules; drop --checkpoint-every/--resume")
    model = build_stages_model(job, cfg.seed)
    ranges = stage_ranges(model, ctx.world_size, cfg.plan)
    k, K = ctx.rank, ctx.world_size
    module = stage_module(model, *ranges[k]).to(ctx.device)
    params = list(module.parameters())
    opt = job.build_optimizer(params, cfg.lr) if params else None
    sched = job.build_scheduler(opt) if opt is not None else None
    io = _ActivationBytes(module)
    runner = _Autocast(module, cfg, ctx.device.type) if cfg.precision != "fp32" else module
    stage = PipelineStage(runner, k, K, ctx.device, group=worker_groups(K, cfg.device).dense)   # NCCL on CUDA
    schedule_cls = ScheduleGPipe if cfg.schedule == "torch-gpipe" else Schedule1F1B

    def loss_fn(output, target):
        return job.compute_loss(output, target)

    schedule = schedule_cls(stage, cfg.micro_batches, loss_fn=loss_fn)
    first, last = k == 0, k == K - 1
    batches = job.batches(0, 1, cfg.batch_size) if (first or last) else None
    meter = StepMeter(ctx, cfg.batch_size)
    step_s = []
    meter.start()
    for step in range(cfg.steps):
        x = y = None
        if batches is not None:
            x, y = (move_to(t, ctx.device) for t in _draw(batches, cfg.seed, step))
        t0 = time.perf_counter()
        losses: list = []
        if first and last:
            schedule.step(x, target=y, losses=losses)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
        step_s.append(time.perf_counter() - t0)
        loss = float("nan")
        if last:
            loss = float(sum(l.detach() for l in losses) / len(losses))
        if K > 1:
            t = torch.tensor([loss], dtype=torch.float64)   # a CPU value: over the default (gloo) group
            if last:
                dist.send(t, 0)
            elif first:
                dist.recv(t, K - 1)
                loss = float(t)
        # what crossed the stage boundaries: activations out and their gradients back in
        # (same sizes), counted from the stage's own inputs and outputs
        into, out = io.take()
        fwd, bwd = (out if not last else 0), (into if not first else 0)
        remote = (fwd if not last and ctx.is_remote(k + 1) else 0) + (bwd if not first and ctx.is_remote(k - 1) else 0)
        meter.end(loss, fwd + bwd, fwd + bwd, extra={"stage": k}, sent_remote=remote)
    mine = {"stage": k, "layers": list(ranges[k]), "compute_s": sum(step_s) / len(step_s)}
    payload = ({n: v.detach().cpu() for n, v in module.state_dict().items()}, mine)
    gathered = [None] * K if k == 0 else None
    if K > 1:
        dist.gather_object(payload, gathered, dst=0)
    else:
        gathered = [payload]
    if k != 0:
        return meter.result(None)
    state = {}
    for part, _ in gathered:
        state.update(part)
    model.load_state_dict(state)
    extra = {"schedule": cfg.schedule, "micro_batches": cfg.micro_batches,
             "stages": [f for _, f in gathered], "stage_layers": describe(ranges, model)}
    return meter.result(model.to("cpu"), extra=extra)
