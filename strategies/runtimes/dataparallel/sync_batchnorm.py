"""``hpar run --sync-batchnorm``: BatchNorm statistics over every worker's batch, for the
data-parallel strategies (``allreduce``, ``allreduce-sparse``, the dense part of ``hybrid``,
``fsdp``).

Without it each worker normalises with the mean and variance of its own batch and updates
its own running statistics (buffers no gradient exchange touches): N workers then differ from
one process on the concatenated batch, and from each other. With it every BatchNorm layer
(``torch.nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/3d) becomes torch's
``nn.SyncBatchNorm`` through ``SyncBatchNorm.convert_sync_batchnorm`` over the workers' dense
group, before DDP or ``fully_shard`` wraps the model: in training, the mean and (biased)
variance are those of all N x B samples, the running statistics are updated with them (the
variance unbiased over N x B), and the backward pass sums the statistics' gradients over the
workers, so N workers equal one process on the concatenated batch, buffers included.

Devices: torch's SyncBatchNorm runs on CUDA (its kernels ``batch_norm_stats``,
``batch_norm_gather_stats_with_counts``, ... have no CPU implementation, and its forward raises
"SyncBatchNorm expected input tensor to be on GPU" otherwise; pytorch#78078, CPU support, was
closed unmerged; DDP refuses a CPU module holding a SyncBatchNorm: "SyncBatchNorm layers only
work with GPU modules"). On a CPU worker (gloo) hpar swaps in :class:`GlooSyncBatchNorm`
instead, the same module with the same state (a ``_BatchNorm``, not a SyncBatchNorm, so DDP
takes it), whose training forward computes the statistics in two AllReduces
(the sum and count of every channel, then the sum of squared deviations from the global mean:
the two-pass variance, as exact as one process's) through a differentiable AllReduce
(:class:`_SumOverWorkers`: the backward of a sum over the workers is the sum of the
gradients), and leaves the backward to autograd. Both run outside a compiled region
(``torch.compiler.disable``): hpar's communication never runs inside one.

``evaluate()`` and the model copies hpar hands it run on worker 0 alone: :func:`plain_batchnorm`
turns the layers back into the user's own classes (the same parameters and buffers) around
such a copy, so that a training-mode forward there needs no peer.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

PLAIN = "_hpar_plain_class"  # attribute of a converted layer: the class the user's model gave it


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Qualified names of ``model``'s BatchNorm layers that normalise with batch statistics
    in training (``_BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm; the root is named "")."""
    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


class _SumOverWorkers(torch.autograd.Function):
    """A SUM AllReduce over ``group`` that autograd differentiates: the gradient of a value
    every worker sums is the sum of every worker's gradient of it."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ctx.group)
        return out, None


class GlooSyncBatchNorm(_BatchNorm):
    """A BatchNorm layer of any dimension (input ``(N, C, *)``) whose training forward uses the
    statistics of every worker's batch over ``process_group``, on the CPU (gloo; module
    docstring). In eval mode, or without a process group, it is torch's BatchNorm."""

    process_group = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @torch.compiler.disable
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or not dist.is_initialized():
            return super().forward(input)
        self._check_input_dim(input)
        group = self.process_group or dist.group.WORLD
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as torch's BatchNorm
                factor = 1.0 / float(self.num_batches_tracked)
        x = input.float()
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        local = torch.cat([x.sum(dims), x.new_tensor([x.numel() / x.shape[1]])])
        total = _SumOverWorkers.apply(local, group)
        count, mean = total[-1], total[:-1] / total[-1]
        centred = x - mean.view(shape)
        var = _SumOverWorkers.apply((centred * centred).sum(dims), group) / count
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                n = float(count)
                self.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
                self.running_var.mul_(1 - factor).add_(var.detach() * (factor * n / max(n - 1, 1.0)))
        return out.to(input.dtype)


def convert(model: nn.Module, group, device: torch.device) -> int:
    """Make every BatchNorm layer inside ``model`` synchronise over ``group`` (the workers' dense
    group), in place: ``nn.SyncBatchNorm.convert_sync_batchnorm`` on CUDA; on a CPU ``device``
    each layer's class becomes :class:`GlooSyncBatchNorm`. The same parameters and buffers, so
    an optimizer built on them is still theirs. Returns the number of layers converted. Raises ValueError when ``model``
    itself is a BatchNorm layer (convert_sync_batchnorm would return a new module)."""
    names = batchnorm_layers(model)
    if "" in names:
        raise ValueError("--sync-batchnorm: model() returns a BatchNorm layer itself; wrap it in a module")
    plain = {name: type(model.get_submodule(name)) for name in names}
    if device.type != "cpu":
        converted = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
        assert converted is model
    for name, cls in plain.items():
        layer = model.get_submodule(name)
        setattr(layer, PLAIN, cls)
        if device.type == "cpu":
            layer.__class__ = GlooSyncBatchNorm
            layer.process_group = group
    return len(names)


def to_plain(model: nn.Module) -> list:
    """Turn ``model``'s converted layers (:func:`convert`) into the user's own classes again, in
    place (the same parameters and buffers, no process group): for the model worker 0 keeps
    after training. Returns ``(layer, class, group)`` of each, for :func:`plain_batchnorm`."""
    swapped = []
    for m in model.modules():
        cls = getattr(m, PLAIN, None)
        if cls is not None and isinstance(m, (nn.SyncBatchNorm, GlooSyncBatchNorm)):
            swapped.append((m, type(m), m.process_group))
            m.__class__ = cls
            del m.process_group
    return swapped


@contextlib.contextmanager
def plain_batchnorm(model: nn.Module):
    """Within: :func:`to_plain`, for a copy that worker 0 evaluates alone (a ProcessGroup does
    not deep-copy either); the converted layers are restored on exit."""
    swapped = to_plain(model)
    try:
        yield model
    finally:
        for m, cls, group in swapped:
            m.__class__ = cls
            m.process_group = group
