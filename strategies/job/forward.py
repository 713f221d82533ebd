"""How hpar calls the user's model: ``model(inputs)``, or ``model(**inputs)`` for a dict batch
whose keys are the names the model's ``forward`` takes.

The contract passes ``inputs`` (whatever ``data()`` yields first) to the model as one argument.
Hugging Face models (and Accelerate, and the HF Trainer) are fed the other way: a batch is a
dict ``{"input_ids": ..., "attention_mask": ...}`` and the call is ``model(**batch)``; passing
the dict as one argument makes BERT fail with "'dict' object has no attribute 'size'". So a
dict reaches the model as keyword arguments when its keys name the forward's parameters:

* every key is a named parameter of ``forward`` (``def forward(self, input_ids,
  attention_mask=None)``), or
* ``forward`` takes ``**kwargs`` and at least one key is a named parameter;

otherwise (``def forward(self, batch)`` reading ``batch["ids"]``) the dict is passed whole, as
before. Every runtime, the pre-start check and the profiler call the model through
:func:`call_model`, so the rule is the same everywhere. Wrappers (DDP, ``torch.compile``'s
``OptimizedModule``) are looked through to the module the user wrote.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn


def inner_module(model: nn.Module) -> nn.Module:
    """The module the user wrote inside DDP (``.module``) and ``torch.compile``
    (``._orig_mod``) wrappers, however nested."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = (
                model.module
                if isinstance(getattr(model, "module", None), nn.Module)
                and type(model).__name__ in ("DistributedDataParallel", "DataParallel")
                else None
            )
        if inner is None:
            return model
        model = inner


@functools.lru_cache(maxsize=256)
def _forward_names(cls: type) -> tuple[frozenset, bool]:
    """(named parameters of ``cls.forward`` without ``self``, whether it takes ``**kwargs``)."""
    try:
        sig = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return frozenset(), False
    params = list(sig.parameters.values())[1:]
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return named, any(p.kind == p.VAR_KEYWORD for p in params)


def takes_keywords(model: nn.Module, inputs: Any) -> bool:
    """Whether :func:`call_model` passes ``inputs`` as ``model(**inputs)`` (see the module
    docstring for the rule)."""
    if not isinstance(inputs, dict) or not inputs or not all(isinstance(k, str) for k in inputs):
        return False
    named, var_kw = _forward_names(type(inner_module(model)))
    keys = set(inputs)
    return keys <= named or (var_kw and bool(keys & named))


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` when :func:`takes_keywords`, else ``model(inputs)``."""
    return model(**inputs) if takes_keywords(model, inputs) else model(inputs)


__all__ = ["call_model", "takes_keywords", "inner_module"]
