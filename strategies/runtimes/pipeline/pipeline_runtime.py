"""The ``pipeline`` strategy: one process per stage, activations forward and gradients
backward with torch.distributed point-to-point messages.

Stages: ``cfg.plan.stages`` (the planner's ``[start, end)`` layer ranges) when present, else
contiguous ranges balanced on parameter counts (``stage.stage_ranges``). Every stage builds the
whole model with ``torch.manual_seed(cfg.seed)`` and keeps its own layers, so the initial
weights equal a single process's. world_size = K stages x R replicas (strategies/runtimes/pipeline/replicas.py).
Schedules: strategies/plan/schedules.py (the pass order) and strategies/runtimes/pipeline/prediction.py
(the weights each pass uses); the loop: the training spine (strategies/runtimes/spine.py) with a
stage's step (stage_step.py) and the cross-stage parts of stage_loop.py.

Invariants: the synchronous schedules (gpipe, 1f1b) equal single-process gradient accumulation
(each micro-batch's loss scaled by 1/M, one optimizer step per batch); in the asynchronous ones
a reported step ends when a stage has run the backward (and update) of the batch's last
micro-batch, so a checkpoint holds exactly the updates of the first (s+1)*M micro-batches at
every stage. How data, messages, the asynchronous learning rate and checkpoints work:
docs/pipelines.md, "How it works". Sources: PipeDream's asynchronous 1F1B (Narayanan et al.,
SOSP 2019); GPipe (Huang et al., NeurIPS 2019); linear scaling of the lr (Goyal et al. 2017).
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
    example = (
        None
        if is_declared_sequence(model)
        else example_micro_batch(ctx.job, cfg.batch_size, cfg.micro_batches, cfg.seed)
    )  # the same trace on every stage
    ranges = stage_ranges(model, grid.stages, cfg.plan, example)
    a, b = ranges[k]
    module = stage_module(model, a, b, example).to(ctx.device)
    params = [p for p in module.parameters() if p.requires_grad]  # frozen ones get no optimizer slot
    opt = ctx.job.build_optimizer(params, cfg.lr) if params else None  # a stage with nothing to train: none
    stage = Stage(ctx.job, module, opt, mode_for_schedule(cfg.schedule), k, grid.stages, 1.0 / cfg.micro_batches)
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
