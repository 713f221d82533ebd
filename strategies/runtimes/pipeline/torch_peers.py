"""The peers of hpar's pipeline: torch.distributed.pipelining's schedules on the same model,
batches and micro-batches (``--schedule torch-gpipe|torch-1f1b|torch-interleaved-1f1b|torch-zbv``).

``torch-gpipe`` and ``torch-1f1b`` (ScheduleGPipe, Schedule1F1B) run one stage per process
on hpar's stage cut (``stage.stage_ranges``). ``torch-interleaved-1f1b``
(ScheduleInterleaved1F1B, Narayanan et al., SC 2021) and ``torch-zbv`` (ScheduleZBVZeroBubble,
Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6) run two virtual stages
per process: the layers are cut into 2K contiguous chunks balanced like hpar's stages, and
process k holds chunks k and k+K (interleaved, the "loop" placement) or k and 2K-1-k (ZB-V's
"V" placement, so process 0 holds the first and the last chunk). Every chunk starts from the
same seeded initial weights as a single process; the first chunk's process takes the
inputs and the last chunk's the targets of ``job.batches(0, 1, batch_size)``. torch splits
the batch into micro-batches itself, runs the passes and scales gradients by 1/M
(``scale_grads=True``); every process then takes one optimizer step. So these runs are the
same math as hpar's ``gpipe``/``1f1b`` and differ only in the schedule and runtime, which is
what the benchmark compares.

Per-stage figures as hpar's own schedules report them: ``compute_s`` and ``idle_s`` per step
(the bubble), bytes that crossed the process boundary, and ``peak_mem_bytes``
(strategies/common/measured_memory.py). torch does not expose when a schedule waits, so on CPU
compute is the process's CPU time over the step (``time.process_time``: blocked in a gloo
receive costs none) and idle the rest of the wall-clock step; on CUDA the split is not
measured (None) and ``compute_s`` is the step time.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hpar.strategies.state import state as run_state
from hpar.strategies.job.context import StepMeter, TrainResult, WorkerContext, move_to
from hpar.strategies.common.devices import DeviceClock
from hpar.strategies.common.groups import worker_groups
from hpar.strategies.common.measured_memory import PeakMemory
from hpar.strategies.job.loop import autocast
from hpar.strategies.job.first_batch import check_first_batch, first_batch
from hpar.strategies.common.gather import gather_json
from hpar.strategies.runtimes import spine
from hpar.strategies.runtimes.spine import StepOutcome, TrainStep
from hpar.strategies.runtimes.pipeline.stage import build_stages_model, describe, stage_module
from hpar.strategies.plan.stage_cuts import VIRTUAL_STAGES, draw_batch, stage_ranges


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


def chunk_ranks(schedule: str, num_ranks: int) -> list[int]:
    """The process (rank) of each chunk, in layer order: ``[0, 1, .., K-1]`` for one stage per
    process, ``[0..K-1, 0..K-1]`` for interleaved 1F1B, ``[0..K-1, K-1..0]`` for ZB-V."""
    K = num_ranks
    if VIRTUAL_STAGES[schedule] == 1:
        return list(range(K))
    if schedule == "torch-interleaved-1f1b":
        return list(range(K)) * 2
    return list(range(K)) + list(range(K - 1, -1, -1))


def _schedule(cfg, stages: list, loss_fn):
    from torch.distributed import pipelining as pp

    cls = {
        "torch-gpipe": pp.ScheduleGPipe,
        "torch-1f1b": pp.Schedule1F1B,
        "torch-interleaved-1f1b": pp.ScheduleInterleaved1F1B,
        "torch-zbv": pp.ScheduleZBVZeroBubble,
    }[cfg.schedule]
    return cls(stages[0] if len(stages) == 1 else stages, cfg.micro_batches, loss_fn=loss_fn)


class _StageRunner(torch.nn.Module):
    """What torch's PipelineStage runs for one chunk: the chunk's forward under the run's
    ``torch.autocast`` (``--precision bf16``; the activations it sends are then bf16, as in
    hpar's own schedules), returning a new tensor where the chunk hands its input back
    unchanged (a chunk of ``nn.Identity``): some torch versions (2.11) then find no input
    gradient to send back and stop with "has gradients None"; a view carries it."""

    def __init__(self, module: torch.nn.Module, cfg, device_type: str):
        super().__init__()
        self.inner, self.cfg, self.device_type = module, cfg, device_type

    def forward(self, x):
        with autocast(self.cfg, self.device_type):
            out = self.inner(x)
        return out.view_as(out) if out is x else out


class TorchPeerStep(TrainStep):
    """This process's chunks under torch's schedule, for the training spine
    (strategies/runtimes/spine.py): a step is one ``schedule.step`` over the batch, then one
    optimizer step and the script's schedule; the loss goes from the last chunk's process to
    rank 0. No checkpoints (refused before anything starts) and no evaluate() during training;
    a step's time runs from the end of the one before (``restart_timer`` False).
    Raises ValueError as hpar's pipeline does (non-sequential model, fewer layers than
    chunks, micro-batches that do not divide the batch)."""

    restart_timer = False

    def __init__(self, ctx: WorkerContext):
        from torch.distributed.pipelining import PipelineStage

        super().__init__(ctx)
        cfg, job = ctx.cfg, ctx.job
        if cfg.batch_size % cfg.micro_batches:
            raise ValueError(
                f"--micro-batches {cfg.micro_batches} does not divide --batch-size {cfg.batch_size}; choose a divisor"
            )
        if cfg.checkpoint_every or cfg.resume:
            raise ValueError(
                f"--schedule {cfg.schedule}: checkpoints are only supported by hpar's own schedules; drop --checkpoint-every/--resume"
            )
        self.model = build_stages_model(job, cfg.seed)
        self.k, K = ctx.rank, ctx.world_size
        self.owner = chunk_ranks(cfg.schedule, K)
        n = len(self.owner)
        self.ranges = stage_ranges(self.model, n, cfg.plan if n == K else None)
        self.mine = [c for c in range(n) if self.owner[c] == self.k]
        self.modules = [stage_module(self.model, *self.ranges[c]).to(ctx.device) for c in self.mine]
        params = [p for m in self.modules for p in m.parameters() if p.requires_grad]  # frozen ones: no slot
        self.opt = job.build_optimizer(params, cfg.lr) if params else None
        self.sched = job.build_scheduler(self.opt) if self.opt is not None else None
        self.ios = [_ActivationBytes(m) for m in self.modules]
        group = worker_groups(K, cfg.device).dense  # NCCL on CUDA
        runners = [_StageRunner(m, cfg, ctx.device.type) for m in self.modules]
        stages = [PipelineStage(r, c, n, ctx.device, group=group) for r, c in zip(runners, self.mine)]
        self.schedule = _schedule(cfg, stages, lambda output, target: job.compute_loss(output, target))
        self.first, self.last = 0 in self.mine, n - 1 in self.mine
        self.batches = job.batches(0, 1, cfg.batch_size) if (self.first or self.last) else None
        self.samples_per_step = cfg.batch_size
        self.mem, self.clock = PeakMemory(ctx.device), DeviceClock(ctx.device)
        self.step_s, self.cpu_s = [], []

    def begin(self) -> None:
        cfg = self.cfg
        self.mem.start()
        self.drawn = (
            {0: first_batch(lambda s: draw_batch(self.batches, cfg.seed, s))} if self.batches is not None else {}
        )
        # the micro-batches divide it (one pipeline: no replicas to compare); the default group holds the stages only
        check_first_batch(self.ctx, self.drawn[0][0] if self.drawn else None, None, cfg.micro_batches, replica=0)

    def step(self, step: int) -> StepOutcome:
        ctx, k, owner = self.ctx, self.k, self.owner
        x = y = None
        if self.batches is not None:
            x, y = (
                move_to(t, ctx.device)
                for t in (self.drawn.pop(step) if step in self.drawn else draw_batch(self.batches, self.cfg.seed, step))
            )
        t0, c0 = self.clock.now(), time.process_time()  # on CUDA: after the queued kernels (synchronize)
        losses: list = []
        args = (x,) if self.first else ()
        self.schedule.step(*args, target=y if self.last else None, losses=losses if self.last else None)
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if self.sched is not None:
                self.sched.step()
        self.step_s.append(self.clock.now() - t0)
        self.cpu_s.append(time.process_time() - c0)
        loss = float(sum(l.detach() for l in losses) / len(losses)) if self.last else float("nan")
        holder = owner[-1]
        if holder != 0:
            t = torch.tensor([loss], dtype=torch.float64)  # a CPU value: over the default (gloo) group
            if k == holder:
                dist.send(t, 0)
            elif k == 0:
                dist.recv(t, holder)
                loss = float(t)
        sent = remote = 0
        for io, c in zip(self.ios, self.mine):  # activations to the next chunk, their gradients back
            into, out = io.take()
            for nbytes, nb in ((out, c + 1), (into, c - 1)):
                if 0 <= nb < len(owner) and owner[nb] != k:
                    sent += nbytes
                    remote += nbytes if ctx.is_remote(owner[nb]) else 0
        return StepOutcome(loss, sent, sent, sent_remote=remote, extra={"stage": k})

    def evaluate(self, steps_done: int) -> None:
        """Nothing: torch's schedules evaluate only after training."""

    def write_final(self) -> None:
        """This process's figures (its peak memory over the run), then its chunks' layers written
        where they are (strategies/state/state.py)."""
        wall = sum(self.step_s) / len(self.step_s)
        split = self.ctx.device.type == "cpu"
        mine, k = self.mine, self.k
        self.figures = {
            "stage": k,
            "layers": [list(self.ranges[c]) for c in mine] if len(mine) > 1 else list(self.ranges[k]),
            "compute_s": sum(self.cpu_s) / len(self.cpu_s) if split else wall,
            "idle_s": max(0.0, wall - sum(self.cpu_s) / len(self.cpu_s)) if split else None,
            "peak_mem_bytes": self.mem.peak_bytes(),
        }
        run_state.write_final(
            self.cfg.run_dir, {k_: v for m in self.modules for k_, v in run_state.final_entries(m, self.model).items()}
        )

    def result(self, meter: StepMeter) -> TrainResult:
        """Every process's figures on rank 0, which reads the whole model back and returns it."""
        cfg = self.cfg
        # as JSON in a tensor, never a pickle (strategies/common/gather.py)
        gathered = gather_json(self.figures, group_dst=0) if self.ctx.world_size > 1 else [self.figures]
        if self.k != 0:
            return meter.result(None)
        run_state.read_whole(cfg.run_dir, self.model)
        extra = {
            "schedule": cfg.schedule,
            "micro_batches": cfg.micro_batches,
            "stages": gathered,
            "stage_layers": describe(self.ranges, self.model),
        }
        return meter.result(self.model.to("cpu"), extra=extra)


def train(ctx: WorkerContext) -> TrainResult:
    """The chunks of this process as torch PipelineStages under torch's schedule
    (:class:`TorchPeerStep` in the training spine); returns the whole model on rank 0. Raises
    ValueError as hpar's pipeline does; checkpoints are not supported."""
    return spine.train(ctx, TorchPeerStep(ctx))
