"""Where a model is cut into pipeline stages, and what a pipeline run can take, checked
before any process starts: the model's layers, the stages' layer ranges (the planner's, or
balanced on parameter count), micro-batches that divide the batch (and leave BatchNorm two
samples), and which schedules a parameter shared across stages allows (weight tying across
stages: Megatron-LM's rule, ``strategies/runtimes/pipeline/ties.py``). Used by the planner,
the run's checks and the pipeline runtime (``strategies/runtimes/pipeline/stage.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.torch_version import TorchVersion

from hpar.strategies.job.contract import Job
from hpar.strategies.job.layers import model_layers
from hpar.strategies.plan.partition import balanced_ranges
from hpar.strategies.specs.decision import Plan


def sequential_layers(model: torch.nn.Module, example=None) -> list[tuple[str, torch.nn.Module]]:
    """The model's layers (``strategies/job/layers.py``: ``hpar_layers()``, the top-level
    children of an ``nn.Sequential``, or the blocks torch's tracer cuts it between, traced
    on ``example``, one micro-batch of inputs), the same ones the profiler and planner count.
    Raises ValueError explaining why pipelining is not offered otherwise."""
    try:
        return model_layers(model, example)
    except ValueError as exc:
        text = str(exc).removesuffix("; define hpar_layers()")  # said once, with the other ways out
        raise ValueError(
            f"--strategy pipeline: {text}; define hpar_layers(), return nn.Sequential(...) from "
            "model(), or use a data-parallel strategy"
        ) from None


def example_micro_batch(
    job: Job, batch_size: int, micro_batches: int, seed: int = 0, replica: int = 0, replicas: int = 1
):
    """The inputs of the first micro-batch of replica ``replica``'s first batch (drawn as the
    run draws it, :func:`draw_batch`): what a traced model's layers are traced on."""
    inputs, _ = draw_batch(job.batches(replica, replicas, batch_size), seed, 0)
    return split_micro(inputs, micro_batches)[0]


def stage_ranges(
    model: torch.nn.Module, num_stages: int, plan: Plan | None = None, example=None
) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` layer ranges of the stages: ``plan.stages`` when the planner gave
    them, else contiguous ranges balanced on parameter count (+1 per layer, so layers
    without parameters also spread). Raises ValueError for fewer layers than stages or a plan
    that does not cover the layers with ``num_stages`` contiguous ranges."""
    layers = sequential_layers(model, example)
    n = len(layers)
    if plan is not None and plan.stages:
        ranges = tuple((int(a), int(b)) for a, b in plan.stages)
        ok = (
            len(ranges) == num_stages
            and ranges[0][0] == 0
            and ranges[-1][1] == n
            and all(a < b for a, b in ranges)
            and all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
        )
        if not ok:
            raise ValueError(
                f"plan stages {list(ranges)} do not split the model's {n} layers into {num_stages} contiguous stages (--gpus / --pipeline-replicas); re-run `hpar profile` for this model and --gpus"
            )
        return ranges
    weights = [1 + sum(p.numel() for p in layer.parameters()) for _, layer in layers]
    return balanced_ranges(weights, num_stages)


def check_pipeline(
    model: torch.nn.Module, num_stages: int, plan: Plan | None, micro_batches: int, batch_size: int, example=None
) -> tuple[tuple[int, int], ...]:
    """What the pipeline runtime will check after its processes start, checked before: the
    model can be cut into layers (``example``: one micro-batch, for a traced model), the
    plan's stages split them into ``num_stages`` contiguous ranges (or they can be balanced),
    ``micro_batches`` divides ``batch_size``, and leaves at least 2 samples to a micro-batch of a
    model with BatchNorm (:func:`check_batchnorm_micro`). Returns the stage ranges; raises
    ValueError with the fix."""
    if micro_batches < 1 or batch_size % micro_batches:
        raise ValueError(f"--micro-batches {micro_batches} does not divide --batch-size {batch_size}; choose a divisor")
    check_batchnorm_micro(model, micro_batches, batch_size)
    count = len(sequential_layers(model, example))
    if count < num_stages:
        raise ValueError(
            f"{num_stages} pipeline stages (--gpus / --pipeline-replicas): the model has only "
            f"{count} layers; use fewer stages (lower --gpus or raise "
            "--pipeline-replicas) or a data-parallel strategy"
        )
    return stage_ranges(model, num_stages, plan, example)


def batchnorm_names(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s BatchNorm layers (BatchNorm1d/2d/3d, SyncBatchNorm: ``_BatchNorm``),
    which normalise a micro-batch by its own statistics in training."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return [name or "the model" for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def check_batchnorm_micro(model: torch.nn.Module, micro_batches: int, batch_size: int) -> None:
    """Raise ValueError (one line naming the flags and the counts that work) when ``model`` has a
    BatchNorm layer and ``micro_batches`` leave one sample to a micro-batch: BatchNorm cannot
    normalise one sample per channel in training (torch: "Expected more than 1 value per
    channel when training")."""
    names = batchnorm_names(model) if batch_size // max(micro_batches, 1) < 2 else []
    if names:
        fits = max(
            (d for d in range(1, batch_size // 2 + 1) if batch_size % d == 0 and batch_size // d >= 2), default=0
        )
        fix = f"use --micro-batches {fits} or fewer" if fits else f"raise --batch-size to {2 * micro_batches}"
        raise ValueError(
            f"--micro-batches {micro_batches} leaves one sample of --batch-size {batch_size} to a "
            f"micro-batch, and BatchNorm layer {names[0]!r} needs at least 2 in training; {fix}"
        )


def draw_batch(batches, seed: int, step: int):
    """The next ``(inputs, targets)`` of ``batches`` drawn under torch's global CPU RNG seeded by
    (``seed``, ``step``) and restored afterwards, so that the first stage (inputs) and the last
    (targets) of every pipeline runtime draw the same batch from their own iterators. Only the
    CPU generator: ``torch.manual_seed`` would also reseed every CUDA generator (the model's
    dropout), which ``fork_rng(devices=[])`` does not restore, and where CUDA is not yet
    initialised it formats a stack trace each call (BENCHMARKS.md, "The cost model against measurement")."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed * 1_000_003 + step)
        return next(batches)


def split_micro(obj: Any, num_micro: int) -> list[Any]:
    """Split a batch (tensor, or tuple/list/dict of tensors, along dim 0) into ``num_micro``
    equal micro-batches. Raises ValueError naming ``--micro-batches`` when it does not divide."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] % num_micro:
            raise ValueError(
                f"--micro-batches {num_micro} does not divide the batch of {obj.shape[0] if obj.dim() else 1} samples; choose a divisor of --batch-size"
            )
        return list(obj.chunk(num_micro))
    if isinstance(obj, (tuple, list)):
        parts = [split_micro(x, num_micro) for x in obj]
        return [type(obj)(p[i] for p in parts) for i in range(num_micro)]
    if isinstance(obj, dict):
        parts = {k: split_micro(v, num_micro) for k, v in obj.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(num_micro)]
    return [obj] * num_micro


def schedule_problem(shared: dict, schedule: str) -> str:
    """Why ``schedule`` cannot run a pipeline whose ``shared`` parameters (name -> stages
    holding it, or (stages, parameter)) span several stages ("" when it can): an asynchronous
    schedule steps the stages at different times (module docstring)."""
    if not shared or schedule in ("gpipe", "1f1b"):
        return ""
    name, stages = next(iter(shared.items()))
    stages = stages[0] if isinstance(stages[0], tuple) else stages
    return (
        f"--schedule {schedule}: parameter {name!r} is shared by stages {', '.join(map(str, stages))} (tied "
        "weights); an asynchronous schedule steps the stages at different times, so the copies cannot stay one "
        "parameter; use --schedule 1f1b or gpipe, or untie the weights"
    )


def check_schedule(shared: dict, schedule: str) -> None:
    """ValueError (one line, the fix) for :func:`schedule_problem`."""
    problem = schedule_problem(shared, schedule)
    if problem:
        raise ValueError(problem)


#: schedule -> number of virtual stages (chunks) per process
VIRTUAL_STAGES = {"torch-gpipe": 1, "torch-1f1b": 1, "torch-interleaved-1f1b": 2, "torch-zbv": 2}


ZBV_GLOO_MIN_TORCH = (2, 12)  # torch 2.11's ZB-V sends from a process to itself, which gloo refuses


def check_peer(
    schedule: str,
    num_layers: int,
    num_ranks: int,
    micro_batches: int,
    device: str = "cpu",
    torch_version: str = torch.__version__,
) -> None:
    """ValueError with the fix when torch's ``schedule`` cannot run this model on ``num_ranks``
    processes with ``micro_batches`` micro-batches on ``device`` ("cpu": gloo, "cuda": NCCL)
    under ``torch_version`` (checked before any process starts)."""
    chunks = VIRTUAL_STAGES[schedule] * num_ranks
    if num_layers < chunks:
        raise ValueError(
            f"--schedule {schedule} cuts the model into {chunks} chunks ({VIRTUAL_STAGES[schedule]} per "
            f"process) but it has {num_layers} layers; use fewer --gpus or --schedule torch-1f1b"
        )
    if schedule == "torch-1f1b" and micro_batches < num_ranks:
        raise ValueError(
            f"--micro-batches {micro_batches}: torch.distributed.pipelining's Schedule1F1B needs "
            f"at least one per stage ({num_ranks}); raise it or use --schedule torch-gpipe"
        )
    rounds = max(1, micro_batches // num_ranks)
    if schedule == "torch-interleaved-1f1b" and micro_batches % rounds:
        raise ValueError(
            f"--micro-batches {micro_batches}: ScheduleInterleaved1F1B needs a multiple of "
            f"{rounds} (micro-batches // processes); use {rounds * (micro_batches // rounds)}"
        )
    if schedule == "torch-zbv" and device == "cpu" and TorchVersion(torch_version) < ZBV_GLOO_MIN_TORCH:
        # torch 2.11's ZB-V opens its links with a send from the process holding the V's turn to
        # itself, which gloo refuses ("Pair is not connected"); 2.12 and 2.13 run it
        raise ValueError(
            f"--schedule torch-zbv on CPU (gloo) needs torch 2.12 or later (this is torch {torch_version}, "
            "whose ZB-V sends from a process to itself); upgrade torch or use --schedule torch-interleaved-1f1b"
        )
