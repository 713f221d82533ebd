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
from hpar.strategies.job.layers import stage_of
from hpar.strategies.plan.stage_cuts import sequential_layers
from hpar.strategies.plan.schedules import Op
from hpar.strategies.runtimes.pipeline.prediction import PassWeights


def stage_module(model: torch.nn.Module, start: int, end: int, example=None) -> torch.nn.Module:
    """Layers ``[start, end)`` of the model under their original names, so the stage's
    state_dict keys equal the whole model's (``strategies/layers.stage_of``)."""
    sequential_layers(model, example)  # the pipeline's error message for a model that cannot be cut
    return stage_of(model, start, end, example)


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

    def __init__(
        self,
        job: Job,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        mode: str,
        index: int,
        num_stages: int,
        loss_scale: float,
    ):
        self.job, self.module, self.optimizer = job, module, optimizer
        self.index, self.num_stages, self.loss_scale = index, num_stages, loss_scale
        self.weights = PassWeights(module, optimizer, mode, max(1, round(1 / loss_scale)))
        self.saved: dict[int, tuple[Any, Any]] = {}
        self.max_in_flight = 0  # most micro-batches held between forward and backward
        self.scale_loss = None  # last stage, fp16: the GradScaler's scale() on each loss before backward
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
            inputs.requires_grad_(True)  # a tuple arrives marked (strategies/runtimes/pipeline/comm.py)
        out = self.weights.forward(op.micro, op.distance, inputs)
        if self.is_last:
            loss = self.job.compute_loss(out, targets)
            scaled = loss * self.loss_scale
            self.saved[op.micro] = (inputs, scaled if self.scale_loss is None else self.scale_loss(scaled))
            if self.keep_output:
                self.output = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
            self.max_in_flight = max(self.max_in_flight, len(self.saved))
            return float(loss.detach())
        if not (
            isinstance(out, torch.Tensor) or isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out)
        ):
            raise ValueError(
                f"--strategy pipeline: stage {self.index} (layers ending at {getattr(self.module, 'layer_names', list(self.module._modules))[-1]!r}) outputs a {type(out).__name__}; activations between stages must be tensors"
            )
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
    return [
        {
            "stage": k,
            "layers": [a, b],
            "names": [n for n, _ in layers[a:b]],
            "params": sum(p.numel() for _, m in layers[a:b] for p in m.parameters()),
        }
        for k, (a, b) in enumerate(ranges)
    ]
