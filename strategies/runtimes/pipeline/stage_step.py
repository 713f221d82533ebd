"""One pipeline stage's training step, for the training spine (strategies/runtimes/spine.py).

A step is one batch of M micro-batches (strategies/runtimes/pipeline/pipeline_runtime.py describes the
strategy)::

    gpipe/1f1b:  the stage's passes of the batch (schedules.stage_ops), then the update:
                 tied gradients summed, replicas averaged, unscale, clip, step (stage_loop.py)
    async-*:     the stage's passes of the run's one stream of micro-batches, up to the
                 backward of the batch's last micro-batch (updates after each backward, or
                 each batch for async-2bw); the guard (--on-divergence) decides after it
    then:        the step's last sends go out, its loss goes from the last stage to the first,
                 bytes, compute and idle seconds are counted

Its state across the passes lives on the :class:`PipelineStep`: the micro-batches drawn but not
yet fed (``inputs``, ``targets``), the last stage's losses of each batch, the targets of the
latest micro-batch (for ``log()``), whether every update of the batch went through
(``stepped``), the tied-gradient bytes of the batch and, in the asynchronous schedules, the
stream of passes and the position in it. Checkpoints come before the evaluation of the same
step (``checkpoint_first``); a step's time runs from the end of the one before
(``restart_timer`` False: asynchronous steps overlap).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpar.strategies.job import loop
from hpar.strategies.job.context import StepMeter, TrainResult, WorkerContext, move_to
from hpar.strategies.common.devices import ComputeTimer
from hpar.strategies.job.first_batch import check_first_batch, first_batch
from hpar.strategies.common.gather import gather_json
from hpar.strategies.common.groups import worker_groups
from hpar.strategies.common.measured_memory import PeakMemory
from hpar.strategies.runtimes.spine import StepOutcome, TrainStep
from hpar.strategies.runtimes.pipeline import divergence as guard, stage_loop
from hpar.strategies.runtimes.pipeline.comm import Links
from hpar.strategies.runtimes.pipeline.replicas import StageReplicas
from hpar.strategies.plan.pipeline_grid import Grid
from hpar.strategies.plan.schedules import is_synchronous, stage_ops, updates_after
from hpar.strategies.runtimes.pipeline.stage import Stage, describe
from hpar.strategies.plan.stage_cuts import draw_batch, sequential_layers, split_micro
from hpar.strategies.runtimes.pipeline.ties import TiedGradients
from hpar.strategies.job.tying import shared_across_stages
from hpar.strategies.plan.stage_cuts import check_schedule
from hpar.strategies.state import checkpoint
from hpar.strategies.state import state as run_state


class PipelineStep(TrainStep):
    """This process's stage in the training spine (module docstring). ``stage``, ``model``
    (the seeded whole model it was cut from), ``ranges`` (every stage's layers) and ``example``
    (the traced micro-batch, or None) come from ``runtime.build_stage``."""

    checkpoint_first = True
    restart_timer = False

    def __init__(self, ctx: WorkerContext, stage: Stage, model: torch.nn.Module, ranges, example=None):
        super().__init__(ctx)
        cfg = ctx.cfg
        self.stage, self.model, self.ranges, self.example = stage, model, ranges, example
        self.grid = Grid.of(cfg)
        self.M, self.K, (self.k, self.r) = cfg.micro_batches, self.grid.stages, self.grid.coords(ctx.rank)
        if cfg.batch_size % self.M:
            raise ValueError(
                f"--micro-batches {self.M} does not divide --batch-size {cfg.batch_size}; choose a divisor"
            )
        # every process writes its stage's state (replicas hold equal copies: DCP writes one) and
        # reads the names its stage holds now, whatever stages wrote them (strategies/state/state.py)
        self.part, self.loop_part = f"stage{self.k}-r{self.r}", f"stage{self.k}"
        self.samples_per_step = cfg.batch_size
        # the script's schedule steps with every optimizer step of this stage: once per batch in
        # the synchronous schedules, once per micro-batch update in the asynchronous ones;
        # clipping and fp16's inf/NaN check span the stages (strategies/runtimes/pipeline/stage_loop.py)
        self.groups = worker_groups(ctx.world_size, cfg.device)
        self.tools = stage_loop.stage_tools(cfg, ctx.job, stage.optimizer, ctx.device, self.groups.dense)

    def resume(self) -> int:
        cfg, ctx = self.cfg, self.ctx
        start = checkpoint.latest_step(cfg.run_dir) if cfg.resume else None
        if start:
            run_state.restore_process(
                cfg.run_dir,
                start,
                self.stage.module,
                self.stage.optimizer,
                self.tools,
                ctx.device,
                self.part,
                self.loop_part,
            )
        return start or 0

    def begin(self) -> None:
        ctx, cfg, stage, grid, M, K, k, r = self.ctx, self.cfg, self.stage, self.grid, self.M, self.K, self.k, self.r
        self.schedule = cfg.schedule
        self.sync = is_synchronous(self.schedule)
        self.stepper = stage_loop.StageStepper(
            cfg,
            self.tools,
            stage.optimizer or stage_loop.placeholder_optimizer(ctx.device),
            self.groups.dense,
            ctx.device,
            self.sync,
            M if cfg.schedule == "async-2bw" else 1,
            copies=grid.replicas,
        )
        if stage.is_last:
            stage.scale_loss = stage_loop.scale_loss(self.tools)
            stage.keep_output = self.job.log_fn is not None
        self.links = Links(k, K, ctx.device, ctx.is_remote, group=self.groups.dense, ranks=grid.pipeline_ranks(r))
        self.replicas = StageReplicas(grid, ctx.rank, cfg.device, ctx.is_remote)  # after worker_groups, on every rank
        shared = shared_across_stages(
            sequential_layers(self.model, self.example), self.ranges
        )  # tied weights on several stages
        check_schedule(shared, cfg.schedule)
        self.ties = TiedGradients(shared, stage.module, grid, k, r, cfg.device)  # after StageReplicas, on every rank
        self.stepper.norm_params = self.ties.counted(self.stepper.params)
        self.batches = self.job.batches(r, grid.replicas, cfg.batch_size) if (stage.is_first or stage.is_last) else None
        self.drawn = {}  # the first batch, drawn before the schedule starts, past those trained on before the checkpoint
        if self.batches is not None and ctx.start_step < cfg.steps:
            self.drawn[ctx.start_step] = first_batch(lambda s: draw_batch(self.batches, cfg.seed, s), ctx.start_step)
        if ctx.start_step < cfg.steps:  # every stage: M divides it, the replicas' are equal (a collective)
            check_first_batch(
                ctx, self.drawn[ctx.start_step][0] if self.drawn else None, self.groups.control, M, replica=r
            )
        self.inputs, self.targets, self.step_losses = {}, {}, {}
        self.stats = {"compute_s": [], "idle_s": [], "sent": [], "recv": [], "memory": PeakMemory(ctx.device)}
        self.stats[
            "memory"
        ].start()  # peak memory of the schedule: activations in flight, weight versions, optimizer state
        self.timer = ComputeTimer(ctx.device)  # CUDA events on a GPU
        self.last_target, self.stepped, self.tied_bytes = None, True, 0
        self.autocast = loop.autocast(cfg, ctx.device.type)
        self.gcfg = guard.GuardConfig(cfg.on_divergence, cfg.divergence_factor)
        self.watch, self.cut = guard.LossWatch(self.gcfg), None
        if not self.sync:  # the run's one stream of passes, from the first micro-batch not yet trained
            self.first, self.i = ctx.start_step * M, 0
            self.ops = stage_ops(self.schedule, K, k, (cfg.steps - ctx.start_step) * M)

    # -- passes ------------------------------------------------------------------------------

    def _feed(self, step: int) -> None:
        x, y = self.drawn.pop(step) if step in self.drawn else draw_batch(self.batches, self.cfg.seed, step)
        device, M = self.ctx.device, self.M
        for i, (xm, ym) in enumerate(zip(split_micro(move_to(x, device), M), split_micro(move_to(y, device), M))):
            if self.stage.is_first:
                self.inputs[step * M + i] = xm
            if self.stage.is_last:
                self.targets[step * M + i] = ym

    def _run(self, op, j: int) -> None:
        """One pass for global micro-batch j (``op.micro`` is local to the op list)."""
        stage, links, timer = self.stage, self.links, self.timer
        if op.kind == "F":
            if (stage.is_first or stage.is_last) and j not in (self.inputs if stage.is_first else self.targets):
                self._feed(j // self.M)
            x = self.inputs.pop(j) if stage.is_first else links.recv_activation()
            if stage.is_last:
                self.last_target = self.targets.pop(j)
            timer.start()
            with self.autocast:
                out = stage.forward(op, x, self.last_target)
            timer.stop()
            if stage.is_last:
                self.step_losses.setdefault(j // self.M, []).append(out)
            else:
                links.send_activation(out)
        else:
            g = None if stage.is_last else links.recv_gradient()
            timer.start()
            grad_in = stage.backward(op, g)
            if updates_after(self.schedule, j, self.M):
                self._update()
            timer.stop()
            if not stage.is_first:
                links.send_gradient(grad_in)

    def _update(self) -> None:
        self.tied_bytes += (
            self.ties.sum_gradients()
        )  # one logical parameter across stages (strategies/runtimes/pipeline/ties.py)
        self.replicas.average_gradients([p for _, p in self.stage.weights.named])
        # gradients are final (replica-averaged): now unscale, clip and step the optimizer
        self.stepped &= self.stepper.step(self.stage)

    # -- steps -------------------------------------------------------------------------------

    def step(self, step: int) -> StepOutcome:
        if self.sync:
            for op in stage_ops(self.schedule, self.K, self.k, self.M):
                self._run(op, step * self.M + op.micro)
            return self._end_step(step)
        while self.i < len(self.ops):  # the stream, up to the backward of the batch's last micro-batch
            op, self.i = self.ops[self.i], self.i + 1
            j = self.first + op.micro
            self._run(op, j)
            if op.kind == "B" and (j + 1) % self.M == 0:
                return self._guarded(j // self.M, self._end_step(j // self.M))
        # the guard cut the stream here and --on-divergence sync finishes the run synchronously
        self.links.flush()
        self.links.wait_sends()
        self.schedule, self.sync, self.stage.weights.mode = "1f1b", True, "sync"
        self.stepper.sync, self.stepper.micro_per_update = True, self.M
        return self.step(step)

    def _guarded(self, step: int, out: StepOutcome) -> StepOutcome:
        """The guard's decision after asynchronous step ``step``: a trip cuts the stream at
        guard.cut_step (a prefix of the passes plus the cool-down); ``out.last`` when
        ``--on-divergence stop`` ends the run with this step."""
        gcfg, cfg = self.gcfg, self.cfg
        if gcfg.action != "off" and self.cut is None and _tripped(self.ctx, self.watch, step, out.loss):
            self.cut = guard.cut_step(self.watch.tripped["step"], self.K, self.M)
            if self.cut < cfg.steps:  # finish the first cut*M micro-batches: a prefix of ops plus cool-down
                self.ops = stage_ops(self.schedule, self.K, self.k, (self.cut - self.ctx.start_step) * self.M)
        out.last = self.cut is not None and step + 1 >= self.cut and gcfg.action != "sync"
        return out

    def _end_step(self, step: int) -> StepOutcome:
        stage, links, replicas, stepper = self.stage, self.links, self.replicas, self.stepper
        links.flush()  # the step's last sends go out before its collectives (replica AllReduce, clipping norm)
        lr = self.tools.lr(stage.optimizer) if stage.optimizer is not None else None
        if self.sync:
            self.timer.start()
            self._update()
            self.timer.stop()
        links.wait_sends(keep=4 * self.K + 8)
        loss = float("nan")
        if stage.is_last:
            loss = replicas.mean_loss(sum(self.step_losses[step]) / len(self.step_losses.pop(step)))
        if self.K > 1 and stage.is_last:
            links.send_loss(loss)
        elif self.K > 1 and stage.is_first:
            loss = links.recv_loss()
        sent, recv, idle, remote = links.take()
        reduced, reduced_remote = replicas.take()
        sent, recv, remote = sent + reduced + self.tied_bytes, recv + reduced + self.tied_bytes, remote + reduced_remote
        self.tied_bytes = 0
        compute, idle = self.timer.take_step(idle)  # on CUDA both from CUDA events
        for key, value in (("compute_s", compute), ("idle_s", idle), ("sent", sent), ("recv", recv)):
            self.stats[key].append(value)
        logged = self.job.run_log(step + 1, stage.output, self.last_target) if stage.keep_output else {}
        out = StepOutcome(
            loss,
            sent,
            recv,
            sent_remote=remote,
            logged=logged,
            lr=lr,
            stepped=self.stepped,
            grad_norm=stepper.last_norm if self.sync and stepper.last_norm is not None else None,
            extra={"stage": self.k, "compute_s": compute, "idle_s": idle},
        )
        self.stepped = True
        return out

    # -- around the steps --------------------------------------------------------------------

    def save(self, steps_done: int) -> None:
        run_state.save(
            self.cfg.run_dir,
            steps_done,
            run_state.process_entries(
                self.stage.module, self.stage.optimizer, self.tools, self.ctx.device, self.part, self.loop_part
            ),
            keep=self.cfg.keep_checkpoints,
        )

    def evaluate(self, steps_done: int) -> None:
        whole = stage_loop.gather_model(self.model, self.stage.module, self.ctx.rank, self.groups.control)
        loop.evaluate_during_training(
            self.job, self.cfg, self.ctx.rank, steps_done, lambda: whole, self.ctx.report_eval
        )

    def write_final(self) -> None:
        """The last sends out; this stage's figures (its peak memory over the schedule); every
        stage writes its layers where they are (replicas: one copy)."""
        self.links.flush()
        self.links.wait_sends()
        stats, stage, k = self.stats, self.stage, self.k
        n = max(len(stats["sent"]), 1)
        self.figures = {
            "stage": k,
            **({"replica": self.r} if self.grid.replicas > 1 else {}),
            "layers": list(self.ranges[k]),
            "compute_s": sum(stats["compute_s"]) / n,
            "idle_s": sum(stats["idle_s"]) / n,
            "bytes_sent": sum(stats["sent"]) / n,
            "bytes_recv": sum(stats["recv"]) / n,
            "max_in_flight": stage.max_in_flight,
            "weight_versions": stage.weights.most_versions,
            "peak_mem_bytes": stats["memory"].peak_bytes(),
        }
        run_state.write_final(self.cfg.run_dir, run_state.final_entries(stage.module, self.model))

    def result(self, meter: StepMeter) -> TrainResult:
        """Every stage's figures gathered on rank 0, which reads the whole model back for
        evaluate() (it built the whole model to cut its stage) and returns it."""
        ctx, cfg, grid = self.ctx, self.cfg, self.grid
        # as JSON in a tensor, never a pickle (strategies/common/gather.py)
        gathered = gather_json(self.figures, group_dst=0) if ctx.world_size > 1 else [self.figures]
        if ctx.rank != 0:
            return meter.result(None)
        run_state.read_whole(cfg.run_dir, self.model)
        more = (
            {"divergence": guard.report(self.gcfg, self.watch.tripped, self.cut, cfg.steps)}
            if self.gcfg.action != "off"
            else {}
        )
        extra = {
            "schedule": cfg.schedule,
            "micro_batches": cfg.micro_batches,
            "pipeline_stages": grid.stages,
            "pipeline_replicas": grid.replicas,
            "pipeline_layout": grid.layout,
            "stages": gathered,
            "stage_layers": describe(self.ranges, self.model, self.example),
            **more,
        }
        return meter.result(self.model.to("cpu"), replicas=grid.replicas, extra=extra)


def _tripped(ctx: WorkerContext, watch: "guard.LossWatch", step: int, loss: float) -> bool:
    """The last stage's guard decision for ``step``, broadcast to every stage (one small
    message per step); fills ``watch.tripped`` on every stage."""
    flag = torch.zeros(3, dtype=torch.float64)  # CPU: the default group is gloo
    if ctx.rank == ctx.world_size - 1 and watch.observe(step, loss):
        t = watch.tripped
        flag = torch.tensor(
            [1.0, t["loss"], t["recent_min"] if t["recent_min"] is not None else float("nan")], dtype=torch.float64
        )
    if ctx.world_size > 1:
        dist.broadcast(flag, src=ctx.world_size - 1)
    if flag[0] and watch.tripped is None:
        low = float(flag[2])
        watch.tripped = {"step": step, "loss": float(flag[1]), "recent_min": None if low != low else low}
    return bool(flag[0])
