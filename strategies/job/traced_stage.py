"""One or more consecutive layers of a traced model run as one module (:class:`TracedStage`):
a layer when the profiler times it, a pipeline stage when a stage runs a range of them. The
layers and how the model is cut into them are strategies/job/traced.py's; this module only
runs sub-graphs of that cut over the whole model's registered tensors, re-targeting factory
calls to the device of the inputs (see traced.py's module docstring for the limits)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_unflatten


class Part:
    """One sub-graph of the split and the top graph's dataflow around it: ``args`` (keys of
    the values it reads), ``outputs`` ((key, index or None) it produces), ``slots`` ((owner
    module in the sub-graph, attribute, whole-model name, is_parameter) of every tensor it
    reads through its attributes) and ``carry`` (keys live after it, in order)."""

    def __init__(self, gm, args, outputs, slots, carry):
        self.gm, self.args, self.outputs, self.slots, self.carry = gm, args, outputs, slots, carry


class TracedStage(nn.Module):
    """Consecutive layers ``parts`` of a :class:`TracedLayers` run as one module (a layer, or a
    pipeline stage): ``forward(value)`` takes the user's inputs (first layer) or the tuple of
    live values of the layer before, and returns the next tuple, or the user's output type
    (last layer). ``tensors``: whole-model name -> parameter or buffer, registered here."""

    def __init__(self, owner, first: int, end: int):  # owner: a traced.TracedLayers
        super().__init__()
        self._owner, self._first, self._end = owner, first, end
        self._parts = owner.parts[first:end]
        self._device = owner.device
        self._where: dict[str, tuple[nn.Module, str, bool]] = {}
        for part in self._parts:
            for _, _, fqn, is_param in part.slots:
                if fqn not in self._where:
                    self._where[fqn] = self._register(fqn, owner.tensors[fqn], is_param, fqn in owner.persistent)

    def _register(
        self, fqn: str, tensor: torch.Tensor, is_param: bool, persistent: bool
    ) -> tuple[nn.Module, str, bool]:
        parent: nn.Module = self
        *path, leaf = fqn.split(".")
        for piece in path:
            if piece not in parent._modules:
                parent.add_module(piece, nn.Module())
            parent = parent._modules[piece]
        if is_param:
            parent.register_parameter(leaf, tensor)
        else:
            parent.register_buffer(leaf, tensor, persistent=persistent)
        return parent, leaf, is_param

    def _point(self, part: Part) -> None:
        """Point the sub-graph's tensor attributes at this module's (live, swapped or moved)."""
        for owner, attr, fqn, is_param in part.slots:
            module, leaf, _ = self._where[fqn]
            (owner._parameters if is_param else owner._buffers)[attr] = (
                module._parameters if is_param else module._buffers
            )[leaf]

    def _retarget(self, device: torch.device) -> None:
        """Re-target the graphs' factory calls from the tracing device to ``device``, and
        move their constant tensors there."""
        for part in self._parts:
            for m in part.gm.modules():
                graph = getattr(m, "graph", None)
                if graph is None:
                    continue
                for node in graph.nodes:
                    if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"] == self._device:
                        node.update_kwarg("device", device)
                for key, value in list(vars(m).items()):
                    if isinstance(value, torch.Tensor) and value.device != device:
                        setattr(m, key, value.to(device))
                _regenerate(m)
        self._device = device

    def forward(self, value):
        owner = self._owner
        if self._first == 0:
            env = owner.bind_inputs(value)
        else:
            env = dict(zip(owner.parts[self._first - 1].carry, value))
        device = next((t.device for t in env.values() if isinstance(t, torch.Tensor)), self._device)
        if device != self._device:
            self._retarget(device)
        for part in self._parts:
            self._point(part)
            result = part.gm(*(env[k] for k in part.args))
            for key, index in part.outputs:
                env[key] = result if index is None else result[index]
        if self._end == len(owner.parts):
            leaves = [env[k] if isinstance(k, str) else k.value for k in owner.output_keys]
            return tree_unflatten(leaves, owner.out_spec)
        return tuple(env[k] for k in self._parts[-1].carry)


def _regenerate(m: nn.Module) -> None:
    """After a change to ``m.graph``: rebuild its generated code (export's InterpreterModule
    keeps a GraphModule for it; a GraphModule recompiles)."""
    if hasattr(m, "finalize"):
        m.finalize()
    elif hasattr(m, "recompile"):
        m.recompile()
