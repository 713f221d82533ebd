"""The ``pipeline`` strategy: one process per stage, activations forward and gradients
backward with torch.distributed point-to-point messages.

Stages: ``cfg.plan["stages"]`` (the planner's ``[start, end)`` layer ranges) when present,
else contiguous ranges balanced on parameter counts (``stage.stage_ranges``). Every stage
builds the whole model with ``torch.manual_seed(cfg.seed)`` and keeps its own layers, so
the initial weights equal a single process's. world_size = K stages x R replicas
(``--gpus``, ``cfg.replicas``; ranks, groups and gradient averaging of the replicas in
``strategies/pipeline/replicas.py``; R = 1 by default).

Data: the first stage takes the inputs and the last stage the targets of the same batches,
both from ``job.batches(r, R, cfg.batch_size)`` (replica r of R). Each draw runs
under ``torch.random.fork_rng`` seeded by (seed, step), so a ``data()`` that uses torch's
global RNG yields the same batches in both processes (other RNGs must be seeded by data()).
A batch is split into ``cfg.micro_batches`` equal micro-batches along dim 0.

Messages: stage k sends each micro-batch's output activation to k+1 (a small int64 header
with dtype and shape over gloo, then the tensor over the workers' dense group, NCCL on CUDA)
and the gradient of its input to k-1 (its shape is known: the activation it received).
Sends are posted together with the stage's next receive (``strategies/pipeline/comm.py``:
deadlock-free on NCCL) and awaited at the end of the step; receives block. Limits: activations between stages must be single tensors.

Schedules (``strategies/pipeline/schedules.py``): ``gpipe`` and ``1f1b`` flush every batch and step
the optimizer once (loss of each micro-batch scaled by 1/M), exactly single-process
gradient accumulation. ``async``, ``async-stash``, ``async-predict`` run PipeDream's
asynchronous 1F1B over the stream of all micro-batches of the run (no flush) and update
after every backward. The loss of each micro-batch is scaled by 1/M there too, so with SGD
each update is lr/M times a micro-batch-mean gradient: the user's per-batch lr moves the
weights as much per sample as in the synchronous schedules (linear scaling, Goyal et al.
2017), only more often (an optimizer with scale-free steps, such as Adam, takes M full
steps per batch instead). Weights per pass from
``strategies/pipeline/prediction.py``. A reported step is one batch of M micro-batches: a
stage ends step s when it has run the backward (and update) of the batch's last
micro-batch. In the asynchronous schedules checkpoints are taken at those boundaries too,
where every stage has applied exactly the updates of the first (s+1)*M micro-batches; on
resume the pipeline refills from there (``async-2bw``'s older version is not saved: the
first batch after a resume runs on the checkpoint's weights). ``async-2bw`` steps once per
batch, after the backward of its last micro-batch. With ``--on-divergence`` the last stage
broadcasts its guard decision every step (``strategies/pipeline/guard.py``).

The training loop (``--clip-grad-norm``, fp16's scaler, the LR schedule, ``--eval-every``, the
script's ``log()``): ``strategies/pipeline/stage_loop.py``, hooked where a stage steps its
optimizer and at the end of each step.

Per step, every stage measures compute seconds (passes and updates), idle seconds (waiting
for messages: the bubble) and bytes sent/received; ``TrainResult.extra["stages"]`` holds
their means per stage (gathered to rank 0), with the stage's peak memory over the run
(``peak_mem_bytes``, strategies/common/memory.py).
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from hpar.strategies.runstate import checkpoint
from hpar.strategies.runstate import state as run_state
from hpar.strategies.common.context import StepMeter, TrainResult, WorkerContext, move_to
from hpar.strategies.common.first_batch import check_first_batch, first_batch
from hpar.strategies.common.gather import gather_json
from hpar.strategies.common.devices import ComputeTimer
from hpar.strategies.common.groups import worker_groups
from hpar.strategies.common import loop
from hpar.strategies.pipeline import stage_loop
from hpar.strategies.pipeline import guard
from hpar.strategies.pipeline.comm import Links
from hpar.strategies.pipeline.replicas import Grid, StageReplicas
from hpar.strategies.common.memory import PeakMemory
from hpar.strategies.pipeline.schedules import is_synchronous, stage_ops, updates_after
from hpar.strategies.models.layers import is_declared_sequence
from hpar.strategies.pipeline.stage import (draw_batch, Stage, build_stages_model, describe, example_micro_batch,
                                            sequential_layers, split_micro, stage_module, stage_ranges)
from hpar.strategies.pipeline.ties import TiedGradients, check_schedule, shared_across_stages
from hpar.strategies.pipeline.prediction import mode_for_schedule


def build_stage(ctx: WorkerContext) -> tuple[Stage, torch.nn.Module, tuple, object]:
    """This process's Stage, the seeded whole model it was cut from, the stage ranges and the
    micro-batch a model that is not a declared sequence was traced on (None otherwise).
    Raises ValueError for a non-sequential model, fewer layers than stages, a bad plan."""
    cfg = ctx.cfg
    grid = Grid.of(cfg)
    k, _ = grid.coords(ctx.rank)
    model = build_stages_model(ctx.job, cfg.seed)
    example = None if is_declared_sequence(model) else \
        example_micro_batch(ctx.job, cfg.batch_size, cfg.micro_batches, cfg.seed)   # the same trace on every stage
    ranges = stage_ranges(model, grid.stages, cfg.plan, example)
    a, b = ranges[k]
    module = stage_module(model, a, b, example).to(ctx.device)
    params = list(module.parameters())
    opt = ctx.job.build_optimizer(params, cfg.lr) if params else None
    stage = Stage(ctx.job, module, opt, mode_for_schedule(cfg.schedule), k, grid.stages,
                  1.0 / cfg.micro_batches)
    return stage, model, ranges, example


def train(ctx: WorkerContext) -> TrainResult:
    """Run this process's stage for ``cfg.steps`` batches under ``cfg.schedule``; returns the
    whole trained model on rank 0 (state dicts gathered from the stages)."""
    cfg, job = ctx.cfg, ctx.job
    if cfg.schedule.startswith("torch-"):
        from hpar.strategies.pipeline import torch_peers
        return torch_peers.train(ctx)
    stage, model, ranges, example = build_stage(ctx)
    grid = Grid.of(cfg)
    M, K, (k, r) = cfg.micro_batches, grid.stages, grid.coords(ctx.rank)
    if cfg.batch_size % M:
        raise ValueError(f"--micro-batches {M} does not divide --batch-size {cfg.batch_size}; choose a divisor")
    # every process writes its stage's state (replicas hold equal copies: DCP writes one) and
    # reads the names its stage holds now, whatever stages wrote them (strategies/runstate/state.py)
    part, loop_part = f"stage{k}-r{r}", f"stage{k}"
    start = checkpoint.latest_step(cfg.run_dir) if cfg.resume else None
    ctx.start_step = start or 0
    # the script's schedule steps with every optimizer step of this stage: once per batch in
    # the synchronous schedules, once per micro-batch update in the asynchronous ones;
    # clipping and fp16's inf/NaN check span the stages (strategies/pipeline/stage_loop.py)
    groups = worker_groups(ctx.world_size, cfg.device)
    tools = stage_loop.stage_tools(cfg, job, stage.optimizer, ctx.device, groups.dense)
    if start:
        run_state.restore_process(cfg.run_dir, start, stage.module, stage.optimizer, tools, ctx.device, part, loop_part)
    stepper = stage_loop.StageStepper(cfg, tools, stage.optimizer or stage_loop.placeholder_optimizer(ctx.device),
                                      groups.dense, ctx.device, is_synchronous(cfg.schedule),
                                      M if cfg.schedule == "async-2bw" else 1, copies=grid.replicas)
    if stage.is_last:
        stage.scale_loss = stage_loop.scale_loss(tools)
        stage.keep_output = job.log_fn is not None
    last_targets = [None]   # the last stage: targets of the latest micro-batch, for log()
    links = Links(k, K, ctx.device, ctx.is_remote, group=groups.dense, ranks=grid.pipeline_ranks(r))
    replicas = StageReplicas(grid, ctx.rank, cfg.device, ctx.is_remote)   # after worker_groups, on every rank
    shared = shared_across_stages(sequential_layers(model, example), ranges)   # tied weights on several stages
    check_schedule(shared, cfg.schedule)
    ties = TiedGradients(shared, stage.module, grid, k, r, cfg.device)   # after StageReplicas, on every rank
    stepper.norm_params = ties.counted(stepper.params)
    batches = job.batches(r, grid.replicas, cfg.batch_size) if (stage.is_first or stage.is_last) else None
    drawn = {}   # the first batch, drawn before the schedule starts, past those trained on before the checkpoint
    if batches is not None and ctx.start_step < cfg.steps:
        drawn[ctx.start_step] = first_batch(lambda s: draw_batch(batches, cfg.seed, s), ctx.start_step)
    if ctx.start_step < cfg.steps:   # every stage: M divides it, the replicas' are equal (a collective)
        check_first_batch(ctx, drawn[ctx.start_step][0] if drawn else None, groups.control, M, replica=r)
    meter = StepMeter(ctx, cfg.batch_size)
    inputs, targets, step_losses = {}, {}, {}
    stats = {"compute_s": [], "idle_s": [], "sent": [], "recv": [], "memory": PeakMemory(ctx.device)}
    stats["memory"].start()   # peak memory of the schedule: activations in flight, weight versions, optimizer state
    timer = ComputeTimer(ctx.device)   # CUDA events on a GPU

    def feed(step: int) -> None:
        x, y = drawn.pop(step) if step in drawn else draw_batch(batches, cfg.seed, step)
        for i, (xm, ym) in enumerate(zip(split_micro(move_to(x, ctx.device), M), split_micro(move_to(y, ctx.device), M))):
            if stage.is_first:
                inputs[step * M + i] = xm
            if stage.is_last:
                targets[step * M + i] = ym

    def run(op, j: int) -> None:
        """One pass for global micro-batch j (``op.micro`` is local to the op list)."""
        if op.kind == "F":
            if (stage.is_first or stage.is_last) and j not in (inputs if stage.is_first else targets):
                feed(j // M)
            x = inputs.pop(j) if stage.is_first else links.recv_activation()
            if stage.is_last:
                last_targets[0] = targets.pop(j)
            timer.start()
            with autocast:
                out = stage.forward(op, x, last_targets[0])
            timer.stop()
            if stage.is_last:
                step_losses.setdefault(j // M, []).append(out)
            else:
                links.send_activation(out)
        else:
            g = None if stage.is_last else links.recv_gradient()
            timer.start()
            grad_in = stage.backward(op, g)
            if updates_after(schedule, j, M):
                update()
            timer.stop()
            if not stage.is_first:
                links.send_gradient(grad_in)

    def update() -> None:
        tied_bytes[0] += ties.sum_gradients()   # one logical parameter across stages (strategies/pipeline/ties.py)
        replicas.average_gradients([p for _, p in stage.weights.named])
        # gradients are final (replica-averaged): now unscale, clip and step the optimizer
        stepped[0] &= stepper.step(stage)

    def end_step(step: int) -> None:
        links.flush()   # the step's last sends go out before its collectives (replica AllReduce, clipping norm)
        lr = tools.lr(stage.optimizer) if stage.optimizer is not None else None
        if sync:
            timer.start()
            update()
            timer.stop()
        links.wait_sends(keep=4 * K + 8)
        loss = float("nan")
        if stage.is_last:
            loss = replicas.mean_loss(sum(step_losses[step]) / len(step_losses.pop(step)))
        if K > 1 and stage.is_last:
            links.send_loss(loss)
        elif K > 1 and stage.is_first:
            loss = links.recv_loss()
        sent, recv, idle, remote = links.take()
        reduced, reduced_remote = replicas.take()
        sent, recv, remote = sent + reduced + tied_bytes[0], recv + reduced + tied_bytes[0], remote + reduced_remote
        tied_bytes[0] = 0
        compute, idle = timer.take_step(idle)    # on CUDA both from CUDA events
        stats["compute_s"].append(compute); stats["idle_s"].append(idle)
        stats["sent"].append(sent); stats["recv"].append(recv)
        logged = job.run_log(step + 1, stage.output, last_targets[0]) if stage.keep_output else {}
        meter.end(loss, sent, recv, {"stage": k, "compute_s": compute, "idle_s": idle,
                                     **({"lr": lr} if lr is not None else {}),
                                     **({"grad_norm": float(stepper.last_norm)} if sync and stepper.last_norm is not None else {}),
                                     **({} if stepped[0] else {"skipped_step": 1})}, sent_remote=remote, logged=logged)
        stepped[0] = True
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            run_state.save(cfg.run_dir, step + 1, run_state.process_entries(
                stage.module, stage.optimizer, tools, ctx.device, part, loop_part), keep=cfg.keep_checkpoints)
        if loop.evaluate_now(cfg, step + 1):   # every stage sends its weights; stage 0 evaluates
            whole = stage_loop.gather_model(model, stage.module, ctx.rank, groups.control)
            loop.evaluate_during_training(job, cfg, ctx.rank, step + 1, lambda: whole, ctx.report_eval)
        return loss

    def run_sync(first_step: int) -> None:
        for step in range(first_step, cfg.steps):
            for op in stage_ops(schedule, K, k, M):
                run(op, step * M + op.micro)
            end_step(step)

    schedule = cfg.schedule
    sync = is_synchronous(schedule)
    stepped = [True]   # whether every optimizer step of this stage in the current batch went through
    tied_bytes = [0]   # bytes of the tied-gradient AllReduces in the current batch
    autocast = loop.autocast(cfg, ctx.device.type)
    gcfg = guard.GuardConfig(cfg.on_divergence, cfg.divergence_factor)
    watch, cut = guard.LossWatch(gcfg), None
    meter.start()
    if sync:
        run_sync(ctx.start_step)
    else:
        first = ctx.start_step * M
        ops, i = stage_ops(schedule, K, k, (cfg.steps - ctx.start_step) * M), 0
        while i < len(ops):
            op, i = ops[i], i + 1
            j = first + op.micro
            run(op, j)
            if op.kind == "B" and (j + 1) % M == 0:
                loss = end_step(j // M)
                if gcfg.action != "off" and cut is None and _tripped(ctx, watch, j // M, loss):
                    cut = guard.cut_step(watch.tripped["step"], K, M)
                    if cut < cfg.steps:   # finish the first cut*M micro-batches: a prefix of ops plus cool-down
                        ops = stage_ops(schedule, K, k, (cut - ctx.start_step) * M)
        if cut is not None and cut < cfg.steps and gcfg.action == "sync":
            links.flush()
            links.wait_sends()
            schedule, sync, stage.weights.mode = "1f1b", True, "sync"
            stepper.sync, stepper.micro_per_update = True, M
            run_sync(cut)
    links.flush()
    links.wait_sends()
    extra = {"divergence": guard.report(gcfg, watch.tripped, cut, cfg.steps)} if gcfg.action != "off" else {}
    return _finish(ctx, grid, stage, model, ranges, meter, stats, extra, example)


def _tripped(ctx: WorkerContext, watch: "guard.LossWatch", step: int, loss: float) -> bool:
    """The last stage's guard decision for ``step``, broadcast to every stage (one small
    message per step); fills ``watch.tripped`` on every stage."""
    flag = torch.zeros(3, dtype=torch.float64)   # CPU: the default group is gloo
    if ctx.rank == ctx.world_size - 1 and watch.observe(step, loss):
        t = watch.tripped
        flag = torch.tensor([1.0, t["loss"], t["recent_min"] if t["recent_min"] is not None else float("nan")],
                            dtype=torch.float64)
    if ctx.world_size > 1:
        dist.broadcast(flag, src=ctx.world_size - 1)
    if flag[0] and watch.tripped is None:
        low = float(flag[2])
        watch.tripped = {"step": step, "loss": float(flag[1]), "recent_min": None if low != low else low}
    return bool(flag[0])


def _finish(ctx: WorkerContext, grid: Grid, stage: Stage, model: torch.nn.Module, ranges, meter: StepMeter,
            stats: dict, more: dict | None = None, example=None) -> TrainResult:
    """Gather the stages' state dicts (replica 0's: the replicas are identical) and every
    worker's figures on rank 0; rank 0 returns the whole model."""
    n = max(len(stats["sent"]), 1)
    k, r = grid.coords(ctx.rank)
    mine = {"stage": k, **({"replica": r} if grid.replicas > 1 else {}), "layers": list(ranges[k]),
            "compute_s": sum(stats["compute_s"]) / n, "idle_s": sum(stats["idle_s"]) / n,
            "bytes_sent": sum(stats["sent"]) / n, "bytes_recv": sum(stats["recv"]) / n,
            "max_in_flight": stage.max_in_flight, "weight_versions": stage.weights.most_versions,
            "peak_mem_bytes": stats["memory"].peak_bytes()}
    # every stage writes its layers where they are (replicas: one copy), then stage 0 of replica 0
    # reads the whole model back for evaluate() (it built the whole model to cut its stage)
    run_state.write_final(ctx.cfg.run_dir, run_state.final_entries(stage.module, model))
    if ctx.world_size > 1:   # as JSON in a tensor, never a pickle (strategies/common/gather.py)
        gathered = gather_json(mine, group_dst=0)
    else:
        gathered = [mine]
    if ctx.rank != 0:
        return meter.result(None)
    run_state.read_whole(ctx.cfg.run_dir, model)
    extra = {"schedule": ctx.cfg.schedule, "micro_batches": ctx.cfg.micro_batches, "pipeline_stages": grid.stages,
             "pipeline_replicas": grid.replicas, "pipeline_layout": grid.layout,
             "stages": gathered, "stage_layers": describe(ranges, model, example), **(more or {})}
    return meter.result(model.to("cpu"), replicas=grid.replicas, extra=extra)
