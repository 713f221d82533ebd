"""A weight held under several names (tied weights) stored once in the trained model.

GPT-2 ties its output projection to its token embedding: ``model.state_dict()`` lists the one
tensor twice (``transformer.wte.weight`` and ``lm_head.weight``), and torch.distributed.checkpoint
writes every key it is given, so RUN_DIR/model held the weight twice (BENCHMARKS.md, "Peak
memory, predicted and measured"). :func:`stored_once` keeps each tensor under the first name
that a
process's entries give it (the model's ``state_dict`` order: strategies/state/state.py
``write_final``) and records every other name as a ``tied.<name>`` entry whose value is that
first name (a string: a non-tensor item of the checkpoint, read back as data through
strategies/state/safe_read.py). Every process that holds the tie writes the same record, so
the copies DCP deduplicates are equal.

Readers get the other names back as the same tensor: :func:`with_aliases` for a checkpoint read
whole (``state.read_all``, hence ``hpar export`` and the tests' ``final_state``), and
:func:`recorded` for a reader that fills a model in place (``state.read_whole``).
"""

from __future__ import annotations

import torch

from hpar.strategies.state import safe_read

PREFIX = "tied."  # tied.<name>: <the name it is stored under>


def _storage_key(t) -> tuple | None:
    """What makes two tensors one (their data's address, offset, shape, strides and dtype), for
    plain tensors and a DTensor's local part (FSDP2's: a view of its padded shard, which has an
    address also where this rank's part is empty, so every rank decides alike); None for anything
    else (a ShardedTensor, a tensor without storage, a non-tensor), never taken for an alias."""
    if not isinstance(t, torch.Tensor):
        return None
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    if not (type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter)) or t.is_meta:
        return None
    ptr = t.untyped_storage().data_ptr()
    return (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, str(t.device)) if ptr else None


def stored_once(entries: dict) -> dict:
    """``entries`` (``model.<name>`` keys and others) with each ``model.`` tensor under the first
    name it has there, and a ``tied.<name>`` entry (the first name, a string) for every later
    name of the same tensor."""
    first: dict = {}
    out: dict = {}
    for key, value in entries.items():
        k = _storage_key(value) if key.startswith("model.") else None
        if k is not None and k in first:
            out[PREFIX + key[len("model.") :]] = first[k]
            continue
        if k is not None:
            first[k] = key[len("model.") :]
        out[key] = value
    return out


def with_aliases(saved: dict) -> dict:
    """``saved`` (a checkpoint read whole) without its ``tied.`` records and with each recorded
    name as a ``model.`` entry holding the very tensor it names (so ``torch.save`` stores it once
    and ``load_state_dict`` fills both names)."""
    out = {k: v for k, v in saved.items() if not k.startswith(PREFIX)}
    for key, first in saved.items():
        if key.startswith(PREFIX) and isinstance(first, str) and f"model.{first}" in out:
            out.setdefault(f"model.{key[len(PREFIX) :]}", out[f"model.{first}"])
    return out


def recorded(path: str) -> dict[str, str]:
    """``{name: the name it is stored under}`` of the checkpoint in directory ``path`` (its
    ``tied.`` records, read as data; {} when it has none). Raises ``safe_read.UnsafeCheckpoint``."""
    keys = [k for k in safe_read.read_metadata(path).state_dict_metadata if k.startswith(PREFIX)]
    if not keys:
        return {}
    got = dict.fromkeys(keys)
    safe_read.load(path, got)  # top-level keys: flattening leaves them as they are
    return {k[len(PREFIX) :]: v for k, v in got.items() if isinstance(v, str)}


__all__ = ["PREFIX", "stored_once", "with_aliases", "recorded"]
