"""The one definition of "the layers of the model", shared by the profiler, the planner, the
pipeline runtime and the torch.distributed.pipelining peers, so that a plan's stage indices
mean the same layers everywhere.

The layers of a model are, in order:

* the layers returned by ``model.hpar_layers()`` when the model defines it: an
  ``nn.Sequential`` (or a list) of the model's own submodules whose composition, applied in
  order, equals ``model(inputs)``; every trainable parameter of the model must belong to one
  of them;
* otherwise, when the model is an ``nn.Sequential``, its top-level children (a child that is
  itself an ``nn.Sequential`` block, e.g. ``Sequential(conv, bn, relu, pool)``, is one layer).

* otherwise, the layers torch.distributed.pipelining's tracer cuts it into between its
  repeated blocks (a ``transformers`` GPT-2, BERT or Llama, a ResNet, an
  ``nn.TransformerEncoder`` model: ``strategies/job/traced.py``); these need one micro-batch of
  inputs (``example``) to trace the forward on, and pass tuples of tensors between them.

A model wrapped by ``torch.compile`` (or DDP) is cut as the module inside. A model none of
these routes can cut is not offered a pipeline.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from hpar.strategies.job.forward import inner_module
from hpar.strategies.job.traced import traced_layers


def is_declared_sequence(model: nn.Module) -> bool:
    """Whether the model says its layers itself: ``hpar_layers()``, or an ``nn.Sequential``."""
    model = inner_module(model)
    return callable(getattr(model, "hpar_layers", None)) or isinstance(model, nn.Sequential)


def model_layers(model: nn.Module, example=None) -> list[tuple[str, nn.Module]]:
    """The model's layers as ``(dotted name in the model, module)`` pairs (see the module
    docstring); ``example``: one micro-batch of inputs, needed for a model that is not a
    declared sequence (it is traced). Raises ValueError, saying why and what to change, when
    the model cannot be cut, ``hpar_layers()`` returns something else, names a module that is
    not the model's own, repeats one, or leaves a trainable parameter outside every layer."""
    model = inner_module(model)
    if not is_declared_sequence(model):
        if example is None:
            raise ValueError(
                f"model is a {type(model).__name__}, not an nn.Sequential, and has no hpar_layers(); "
                "its layers come from tracing it on a micro-batch"
            )
        return traced_layers(model, example).layers
    names = {id(m): n for n, m in model.named_modules() if n}
    if callable(getattr(model, "hpar_layers", None)):
        seq = model.hpar_layers()
        if not isinstance(seq, (nn.Sequential, list, tuple)) or not all(isinstance(m, nn.Module) for m in seq):
            raise ValueError(
                f"hpar_layers() returned {type(seq).__name__}, expected an nn.Sequential (or list) "
                "of the model's own layers in forward order"
            )
        layers = []
        for i, m in enumerate(seq):
            if id(m) not in names:
                raise ValueError(
                    f"hpar_layers() item {i} ({type(m).__name__}) is not a submodule of the model; "
                    "return the model's own layers (e.g. nn.Sequential(self.embed, *self.blocks, self.head))"
                )
            layers.append((names[id(m)], m))
        if len({id(m) for _, m in layers}) != len(layers):
            raise ValueError("hpar_layers() lists a layer twice; list each layer once, in forward order")
        covered = {id(p) for _, m in layers for p in m.parameters()}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
        if missing:
            raise ValueError(
                f"hpar_layers() leaves parameter {missing[0]!r} outside every layer; include the module that owns it"
            )
        return layers
    return list(model.named_children())


class StageModule(nn.Module):
    """Layers ``[start, end)`` of a model, run in order, registered under their names in the
    whole model (``blocks.0`` becomes ``self.blocks[0]``-like nesting), so the stage's
    ``state_dict`` keys equal the whole model's."""

    def __init__(self, layers: list[tuple[str, nn.Module]]):
        super().__init__()
        self.layer_names = [n for n, _ in layers]
        for name, module in layers:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            parent.add_module(leaf, module)

    def forward(self, inputs):
        for name in self.layer_names:
            inputs = self.get_submodule(name)(inputs)
        return inputs


def stage_of(model: nn.Module, start: int, end: int, example=None) -> nn.Module:
    """Layers ``[start, end)`` of ``model`` (:func:`model_layers`) as one module whose
    state_dict keys equal the whole model's. Raises ValueError as model_layers does."""
    layers = model_layers(model, example)
    assert 0 <= start < end <= len(layers), (start, end, len(layers))
    model = inner_module(model)
    if not is_declared_sequence(model):
        return traced_layers(model, example).stage(start, end)
    if isinstance(model, nn.Sequential) and not callable(getattr(model, "hpar_layers", None)):
        return nn.Sequential(OrderedDict(layers[start:end]))
    return StageModule(layers[start:end])


__all__ = ["model_layers", "stage_of", "StageModule", "is_declared_sequence"]
