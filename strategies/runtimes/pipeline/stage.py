"""One pipeline stage's layers and passes, independent of how tensors travel.

Used by the multi-process runtime (``strategies/runtimes/pipeline/pipeline_runtime.py``, tensors over
torch.distributed send/recv) and by the single-process simulator
(``strategies/runtimes/pipeline/sim.py``, tensors handed over in memory), so both run the same
forward, backward, stashing and prediction code.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_map

from hpar.strategies.job.forward import inner_module
from hpar.strategies.job.contract import Job
from hpar.strategies.job.layers import model_layers, stage_of
from hpar.strategies.runtimes.pipeline.partition import balanced_ranges
from hpar.strategies.runtimes.pipeline.schedules import Op
from hpar.strategies.runtimes.pipeline.prediction import PassWeights
from hpar.strategies.plan.decision import Plan


def sequential_layers(model: torch.nn.Module, example=None) -> list[tuple[str, torch.nn.Module]]:
    """The model's layers (``strategies/job/layers.py``: ``hpar_layers()``, the top-level
    children of an ``nn.Sequential``, or the blocks torch's tracer cuts it between, traced
    on ``example``, one micro-batch of inputs), the same ones the profiler and planner count.
    Raises ValueError explaining why pipelining is not offered otherwise."""
    try:
        return model_layers(model, example)
    except ValueError as exc:
        text = str(exc).removesuffix("; define hpar_layers()")   # said once, with the other ways out
        raise ValueError(f"--strategy pipeline: {text}; define hpar_layers(), return nn.Sequential(...) from "
                         "model(), or use a data-parallel strategy") from None


def example_micro_batch(job: Job, batch_size: int, micro_batches: int, seed: int = 0, replica: int = 0,
                        replicas: int = 1):
    """The inputs of the first micro-batch of replica ``replica``'s first batch (drawn as the
    run draws it, :func:`draw_batch`): what a traced model's layers are traced on."""
    inputs, _ = draw_batch(job.batches(replica, replicas, batch_size), seed, 0)
    return split_micro(inputs, micro_batches)[0]


def stage_ranges(model: torch.nn.Module, num_stages: int, plan: Plan | None = None,
                 example=None) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` layer ranges of the stages: ``plan.stages`` when the planner gave
    them, else contiguous ranges balanced on parameter count (+1 per layer, so layers
    without parameters also spread). Raises ValueError for fewer layers than stages or a plan
    that does not cover the layers with ``num_stages`` contiguous ranges."""
    layers = sequential_layers(model, example)
    n = len(layers)
    if plan is not None and plan.stages:
        ranges = tuple((int(a), int(b)) for a, b in plan.stages)
        ok = (len(ranges) == num_stages and ranges[0][0] == 0 and ranges[-1][1] == n
              and all(a < b for a, b in ranges) and all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:])))
        if not ok:
            raise ValueError(f"plan stages {list(ranges)} do not split the model's {n} layers into {num_stages} contiguous stages (--gpus / --pipeline-replicas); re-run `hpar profile` for this model and --gpus")
        return ranges
    weights = [1 + sum(p.numel() for p in layer.parameters()) for _, layer in layers]
    return balanced_ranges(weights, num_stages)


def stage_module(model: torch.nn.Module, start: int, end: int, example=None) -> torch.nn.Module:
    """Layers ``[start, end)`` of the model under their original names, so the stage's
    state_dict keys equal the whole model's (``strategies/layers.stage_of``)."""
    sequential_layers(model, example)   # the pipeline's error message for a model that cannot be cut
    return stage_of(model, start, end, example)


def check_pipeline(model: torch.nn.Module, num_stages: int, plan: Plan | None, micro_batches: int,
                   batch_size: int, example=None) -> tuple[tuple[int, int], ...]:
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
        raise ValueError(f"{num_stages} pipeline stages (--gpus / --pipeline-replicas): the model has only "
                         f"{count} layers; use fewer stages (lower --gpus or raise "
                         "--pipeline-replicas) or a data-parallel strategy")
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
        fits = max((d for d in range(1, batch_size // 2 + 1) if batch_size % d == 0 and batch_size // d >= 2), default=0)
        fix = f"use --micro-batches {fits} or fewer" if fits else f"raise --batch-size to {2 * micro_batches}"
        raise ValueError(f"--micro-batches {micro_batches} leaves one sample of --batch-size {batch_size} to a "
                         f"micro-batch, and BatchNorm layer {names[0]!r} needs at least 2 in training; {fix}")


def draw_batch(batches, seed: int, step: int):
    """The next ``(inputs, targets)`` of ``batches`` drawn under torch's global CPU RNG seeded by
    (``seed``, ``step``) and restored afterwards, so that the first stage (inputs) and the last
    (targets) of every pipeline runtime draw the same batch from their own iterators. Only the
    CPU generator: ``torch.manual_seed`` would also reseed every CUDA generator (the model's
    dropout), which ``fork_rng(devices=[])`` does not restore, and where CUDA is not yet
    initialised it formats a stack trace each call (0.3-0.5 ms a step on a 2-vCPU machine)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed * 1_000_003 + step)
        return next(batches)


def split_micro(obj: Any, num_micro: int) -> list[Any]:
    """Split a batch (tensor, or tuple/list/dict of tensors, along dim 0) into ``num_micro``
    equal micro-batches. Raises ValueError naming ``--micro-batches`` when it does not divide."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] % num_micro:
            raise ValueError(f"--micro-batches {num_micro} does not divide the batch of {obj.shape[0] if obj.dim() else 1} samples; choose a divisor of --batch-size")
        return list(obj.chunk(num_micro))
    if isinstance(obj, (tuple, list)):
        parts = [split_micro(x, num_micro) for x in obj]
        return [type(obj)(p[i] for p in parts) for i in range(num_micro)]
    if isinstance(obj, dict):
        parts = {k: split_micro(v, num_micro) for k, v in obj.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(num_micro)]
    return [obj] * num_micro


class Stage:
    """Stage ``index`` of ``num_stages``: its layers, optimizer and pass weights.

    ``loss_scale`` multiplies each micro-batch loss before backward: 1/M in every schedule.
    In the synchronous ones the M gradients add up to the gradient of the batch-mean loss;
    in the asynchronous ones each update uses 1/M of a micro-batch-mean gradient, so with
    SGD the user's per-batch lr moves the weights by the same amount per sample (an
    update of lr/M per micro-batch, the linear scaling rule of Goyal et al. 2017).
    Activations between stages are tensors (a traced model's: tuples of tensors); the first
    stage's input may be anything the model accepts.
    """

    def __init__(self, job: Job, module: torch.nn.Module, optimizer: torch.optim.Optimizer, mode: str,
                 index: int, num_stages: int, loss_scale: float):
        self.job, self.module, self.optimizer = job, module, optimizer
        self.index, self.num_stages, self.loss_scale = index, num_stages, loss_scale
        self.weights = PassWeights(module, optimizer, mode, max(1, round(1 / loss_scale)))
        self.saved: dict[int, tuple[Any, Any]] = {}
        self.max_in_flight = 0   # most micro-batches held between forward and backward
        self.scale_loss = None   # last stage, fp16: the GradScaler's scale() on each loss before backward
        self.keep_output = False  # last stage: keep the last micro-batch's output (the script's log())
        self.output = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, op: Op, inputs: Any, targets: Any = None) -> Any:
        """Forward of ``op.micro``. Returns the output activation (detached, to send on: a
        tensor, or a traced model's tuple of tensors, those that need a gradient back still
        marked ``requires_grad``), or on the last stage the micro-batch's mean loss as a float."""
        if not self.is_first and isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
            inputs.requires_grad_(True)   # a tuple arrives marked (strategies/runtimes/pipeline/comm.py)
        out = self.weights.forward(op.micro, op.distance, inputs)
        if self.is_last:
            loss = self.job.compute_loss(out, targets)
            scaled = loss * self.loss_scale
            self.saved[op.micro] = (inputs, scaled if self.scale_loss is None else self.scale_loss(scaled))
            if self.keep_output:
                self.output = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
            self.max_in_flight = max(self.max_in_flight, len(self.saved))
            return float(loss.detach())
        if not (isinstance(out, torch.Tensor) or isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out)):
            raise ValueError(f"--strategy pipeline: stage {self.index} (layers ending at {getattr(self.module, 'layer_names', list(self.module._modules))[-1]!r}) outputs a {type(out).__name__}; activations between stages must be tensors")
        self.saved[op.micro] = (inputs, out)
        self.max_in_flight = max(self.max_in_flight, len(self.saved))
        if isinstance(out, tuple):
            return tuple(t.detach().requires_grad_(t.requires_grad) for t in out)
        return out.detach()

    def backward(self, op: Op, grad_output: Any = None) -> Any:
        """Backward of ``op.micro`` (``grad_output`` from the next stage, a tuple for a tuple
        activation: one gradient per tensor that needs one; None on the last). Returns the
        gradient of the stage's input in the same form (None on the first stage)."""
        inputs, out = self.saved.pop(op.micro)
        if isinstance(out, tuple):
            out = [t for t in out if t.requires_grad]
        self.weights.backward(op.micro, op.distance, out, None if self.is_last else grad_output)
        if self.is_first:
            return None
        if isinstance(inputs, tuple):
            return tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs if x.requires_grad)
        return inputs.grad if inputs.grad is not None else torch.zeros_like(inputs)

    def update(self, opt_step=None) -> None:
        """Optimizer step with the gradients gathered since the last one (``opt_step``: see
        ``PassWeights.step``)."""
        self.weights.step(opt_step)


def build_stages_model(job: Job, seed: int) -> torch.nn.Module:
    """The whole model exactly as a single process builds it (seeded), for slicing: the module
    the user wrote, inside a ``torch.compile`` wrapper (a pipeline's stages are pieces of it and
    run eagerly), so that stage state dicts, and the saved model carry the
    user's parameter names."""
    torch.manual_seed(seed)
    return inner_module(job.build_model())


def describe(ranges: Sequence[tuple[int, int]], model: torch.nn.Module, example=None) -> list[dict]:
    """JSON-friendly stage description: layer range, layer names, parameter count."""
    layers = sequential_layers(model, example)
    return [{"stage": k, "layers": [a, b], "names": [n for n, _ in layers[a:b]],
             "params": sum(p.numel() for _, m in layers[a:b] for p in m.parameters())}
            for k, (a, b) in enumerate(ranges)]
