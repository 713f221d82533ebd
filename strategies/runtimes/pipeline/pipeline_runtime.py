"""The ``pipeline`` strategy: one process per stage, activations forward and gradients
backward with torch.distributed point-to-point messages.

Stages: ``cfg.plan.stages`` (the planner's ``[start, end)`` layer ranges) when present,
else contiguous ranges balanced on parameter counts (``stage.stage_ranges``). Every stage
builds the whole model with ``torch.manual_seed(cfg.seed)`` and keeps its own layers, so
the initial weights equal a single process's. world_size = K stages x R replicas
(``--gpus``, ``cfg.replicas``; ranks, groups and gradient averaging of the replicas in
``strategies/runtimes/pipeline/replicas.py``; R = 1 by default).

Data: the first stage takes the inputs and the last stage the targets of the same batches,
both from ``job.batches(r, R, cfg.batch_size)`` (replica r of R). Each draw runs
under ``torch.random.fork_rng`` seeded by (seed, step), so a ``data()`` that uses torch's
global RNG yields the same batches in both processes (other RNGs must be seeded by data()).
A batch is split into ``cfg.micro_batches`` equal micro-batches along dim 0.

Messages: stage k sends each micro-batch's output activation to k+1 (a small int64 header
with dtype and shape over gloo, then the tensor over the workers' dense group, NCCL on CUDA)
and the gradient of its input to k-1 (its shape is known: the activation it received).
Sends are posted together with the stage's next receive (``strategies/runtimes/pipeline/comm.py``:
deadlock-free on NCCL) and awaited at the end of the step; receives block. Limits: activations between stages must be single tensors.

Schedules (``strategies/plan/schedules.py``): ``gpipe`` and ``1f1b`` flush every batch and step
the optimizer once (loss of each micro-batch scaled by 1/M), exactly single-process
gradient accumulation. ``async``, ``async-stash``, ``async-predict`` run PipeDream's
asynchronous 1F1B over the stream of all micro-batches of the run (no flush) and update
after every backward. The loss of each micro-batch is scaled by 1/M there too, so with SGD
each update is lr/M times a micro-batch-mean gradient: the user's per-batch lr moves the
weights as much per sample as in the synchronous schedules (linear scaling, Goyal et al.
2017), only more often (an optimizer with scale-free steps, such as Adam, takes M full
steps per batch instead). Weights per pass from
``strategies/runtimes/pipeline/prediction.py``. A reported step is one batch of M micro-batches: a
stage ends step s when it has run the backward (and update) of the batch's last
micro-batch. In the asynchronous schedules checkpoints are taken at those boundaries too,
where every stage has applied exactly the updates of the first (s+1)*M micro-batches; on
resume the pipeline refills from there (``async-2bw``'s older version is not saved: the
first batch after a resume runs on the checkpoint's weights). ``async-2bw`` steps once per
batch, after the backward of its last micro-batch. With ``--on-divergence`` the last stage
broadcasts its guard decision every step (``strategies/runtimes/pipeline/divergence.py``).

The training loop: the training spine (``strategies/runtimes/spine.py``) with a stage's step
(``strategies/runtimes/pipeline/stage_step.py``: the passes, the guard, the end of a step);
``--clip-grad-norm``, fp16's scaler, the LR schedule, ``--eval-every`` and the script's ``log()``
across stages: ``strategies/runtimes/pipeline/stage_loop.py``, hooked where a stage steps its optimizer
and at the end of each step.

Per step, every stage measures compute seconds (passes and updates), idle seconds (waiting
for messages: the bubble) and bytes sent/received; ``TrainResult.extra["stages"]`` holds
their means per stage (gathered to rank 0), with the stage's peak memory over the run
(``peak_mem_bytes``, strategies/common/measured_memory.py).
"""
from __future__ import annotations

import torch

from hpar.strategies.runtimes import spine
from hpar.strategies.job.context import TrainResult, WorkerContext
from hpar.strategies.job.layers import is_declared_sequence
from hpar.strategies.runtimes.pipeline.prediction import mode_for_schedule
from hpar.strategies.plan.pipeline_grid import Grid
from hpar.strategies.runtimes.pipeline.stage import Stage, build_stages_model, stage_module
from hpar.strategies.plan.stage_cuts import example_micro_batch, stage_ranges
from hpar.strategies.runtimes.pipeline.stage_step import PipelineStep


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
    params = [p for p in module.parameters() if p.requires_grad]   # frozen ones get no optimizer slot
    opt = ctx.job.build_optimizer(params, cfg.lr) if params else None   # a stage with nothing to train: none
    stage = Stage(ctx.job, module, opt, mode_for_schedule(cfg.schedule), k, grid.stages,
                  1.0 / cfg.micro_batches)
    return stage, model, ranges, example


def train(ctx: WorkerContext) -> TrainResult:
    """Run this process's stage for ``cfg.steps`` batches under ``cfg.schedule`` (the training
    spine with strategies/runtimes/pipeline/stage_step.PipelineStep; torch's schedules for ``torch-*``,
    strategies/runtimes/pipeline/torch_peers.py); returns the whole trained model on rank 0 (state
    dicts gathered from the stages). Raises ValueError as :func:`build_stage` does, and for
    ``--micro-batches`` that do not divide ``--batch-size``."""
    if ctx.cfg.schedule.startswith("torch-"):
        from hpar.strategies.runtimes.pipeline import torch_peers
        return torch_peers.train(ctx)
    return spine.train(ctx, PipelineStep(ctx, *build_stage(ctx)))
