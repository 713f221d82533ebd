"""Reading a torch.distributed.checkpoint (DCP) directory as data, never as code.

A checkpoint directory holds pickles, and a run directory may come from elsewhere (a copy, a
shared disk, a download). torch 2.13 runs code from them in two places
(docs/security notes, "DCP checkpoints contain pickles"):

* ``FileSystemReader.read_metadata`` (torch/distributed/checkpoint/filesystem.py) is a plain
  ``pickle.load`` of ``<dir>/.metadata``;
* ``DefaultLoadPlanner.load_bytes`` (torch/distributed/checkpoint/default_planner.py) loads
  every non-tensor (BYTE_IO) item with ``torch.load(..., weights_only=False)``; tensor items
  are already read with ``weights_only=True``.

Here :class:`SafeReader` unpickles the metadata with an allowlist of DCP's own metadata types
(taken from every global that the ``.metadata`` files of hpar's own runs name under torch
2.13: allreduce, fp16, fsdp, pipeline with and without replicas and an asynchronous schedule,
hybrid and ps with ShardedTensor tables, hot-row caches, sparse allreduce; with Adam state and
several LR schedules), and :class:`SafePlanner` loads BYTE_IO items with
``weights_only=True`` (torch's restricted unpickler: plain Python values, tensors, dtypes). A
checksum beside a file proves it is intact, not who wrote it, so the checksums do not help.
Anything else is an :class:`UnsafeCheckpoint`, a one-line ValueError naming the file.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

# dcp.load without a process group says so on every call (state.py filters it too; the launcher's
# check imports only this module)
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

TRUST = "not checkpoint data; refusing to load it (a run directory's files are code: only load runs you trust)"

# Every global a .metadata of hpar's runs names (torch 2.13, pickle protocol 4), but the
# dtypes (any torch.<name> that is a torch.dtype). Names, not modules: pickle resolves a
# dotted name attribute by attribute, so a module-wide rule would reach what it imports.
METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where each item lies
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch.layout pickles: a lookup by name
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the writer's path (a path object)
    }
)


class UnsafeCheckpoint(ValueError):
    """A checkpoint file names something that is not checkpoint data (or cannot be read as
    such); ``str(err)`` is one line naming the file."""


class _Refused(Exception):
    """A global outside :data:`METADATA_GLOBALS`: ``str()`` is ``module.name``."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`METADATA_GLOBALS` and torch dtypes."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]


def read_metadata(path: str) -> Metadata:
    """DCP's ``Metadata`` of the checkpoint in directory ``path`` (``path/.metadata``),
    unpickled with the allowlist. Raises :class:`UnsafeCheckpoint` naming the file when it
    names any other global, is no ``Metadata``, lists an entry that is neither a tensor nor
    bytes, or places an item outside ``path``; OSError when it cannot be read."""
    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        try:
            md = _MetadataUnpickler(f).load()
        except _Refused as exc:
            raise UnsafeCheckpoint(f"{file}: names {exc}, {TRUST}") from None
        except Exception as exc:  # a torn or crafted pickle: whatever the allowed types raise on bad input
            raise UnsafeCheckpoint(
                f"{file}: cannot be read as checkpoint metadata ({_one_line(exc)}); {TRUST}"
            ) from None
    if not (
        isinstance(md, Metadata) and isinstance(md.state_dict_metadata, dict) and isinstance(md.storage_data, dict)
    ):
        raise UnsafeCheckpoint(f"{file}: holds a {type(md).__name__}, {TRUST}")
    for key, item in md.state_dict_metadata.items():  # what DCP and _from_metadata then rely on
        if not (
            isinstance(key, str)
            and (
                isinstance(item, BytesStorageMetadata)
                or (
                    isinstance(item, TensorStorageMetadata)
                    and isinstance(item.size, torch.Size)
                    and isinstance(getattr(item.properties, "dtype", None), torch.dtype)
                )
            )
        ):
            raise UnsafeCheckpoint(f"{file}: lists {str(key)[:80]!r} as a {type(item).__name__}, {TRUST}")
    for info in md.storage_data.values():  # DCP writes plain file names beside .metadata
        rel = getattr(info, "relative_path", None)
        if not (isinstance(rel, str) and rel and os.path.basename(rel) == rel and rel not in (".", "..")):
            raise UnsafeCheckpoint(f"{file}: places an item at {rel!r}, outside the checkpoint; {TRUST}")
    return md


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` is :func:`read_metadata`, followed by
    what torch 2.13's own does after unpickling (a ``StorageMeta`` when there is none, and
    this reader's ``load_id`` in it). It takes no ``rank``: DCP then never falls back to the
    per-rank ``__<rank>.metadata`` files, which hpar does not write."""

    def read_metadata(self) -> Metadata:
        md = read_metadata(str(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def load_bytes(value: io.BytesIO, where: str):
    """One BYTE_IO item (``torch.save`` bytes) read with ``torch.load(weights_only=True)``.
    ``where`` names it in the error. Raises :class:`UnsafeCheckpoint` naming the globals it
    asks for when torch's restricted unpickler refuses it."""
    raw = value.getvalue()
    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(raw))
        except Exception:
            names = re.findall(r"GLOBAL (\S+)", str(exc))[:1]
        if names:
            raise UnsafeCheckpoint(f"{where} names {', '.join(names)}, {TRUST}") from None
        raise UnsafeCheckpoint(f"{where} cannot be read as data ({_one_line(exc)}); {TRUST}") from None


class SafePlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose ``load_bytes`` is :func:`load_bytes` (placing the value
    where torch's would: the nested entry the key was flattened from). ``path``: the
    checkpoint directory, to name the file in errors; ``options``: DefaultLoadPlanner's."""

    def __init__(self, path: str, **options):
        super().__init__(**options)
        self.path = path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        info = self.metadata.storage_data.get(read_item.storage_index)
        where = f"{os.path.join(self.path, getattr(info, 'relative_path', '?'))} (item {fqn})"
        obj = load_bytes(value, where)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load(path: str, state: dict, flat: bool = False) -> None:
    """``dcp.load`` of checkpoint directory ``path`` into ``state`` in this process
    (``no_dist``) through :class:`SafeReader` and :class:`SafePlanner` (``flat``: ``state``'s
    keys are the checkpoint's own, flattened keys, as in its metadata). Raises
    :class:`UnsafeCheckpoint` (unwrapped from DCP's CheckpointException); DCP's own errors
    (a key the checkpoint lacks, a shape that differs) pass as DCP raises them."""
    reader = SafeReader(path)
    reader.read_metadata()  # refused here, before DCP's fallback to per-rank metadata could log it
    try:
        dcp.load(state, storage_reader=reader, planner=SafePlanner(path, flatten_state_dict=not flat), no_dist=True)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        for failure in (getattr(exc, "failures", None) or {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, UnsafeCheckpoint):
                raise UnsafeCheckpoint(str(inner)) from None
        raise


def _from_metadata(md: Metadata, device: str) -> dict:
    """A state dict of everything ``md`` lists, nested as it was saved (DCP's
    ``planner_data`` paths): an empty tensor of the saved size and dtype on ``device`` per
    tensor, None per BYTE_IO item."""
    sd: dict = {}
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            value = torch.empty(item.size, dtype=item.properties.dtype, device=device)
        else:
            assert isinstance(item, BytesStorageMetadata), f"{key}: {type(item).__name__}"
            value = None
        set_element(sd, (md.planner_data or {}).get(key, (key,)), value)
    return sd


def load_all(path: str) -> dict:
    """Everything the checkpoint in ``path`` holds, in this process: tensors whole (shards
    joined) on the CPU, nested dicts as saved (what torch's ``dcp_to_torch_save`` and
    ``torch.load`` give, without their pickles). Raises :class:`UnsafeCheckpoint`."""
    sd = _from_metadata(read_metadata(path), "cpu")
    load(path, sd)
    return sd


def check(path: str) -> None:
    """Refuse the checkpoint in ``path`` before any process loads it: its metadata and every
    BYTE_IO item are read as above (tensors are not read: DCP loads them with
    ``weights_only=True`` anyway). Raises :class:`UnsafeCheckpoint`."""
    md = read_metadata(path)
    load(path, {k: None for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}, flat=True)


__all__ = [
    "TRUST",
    "METADATA_GLOBALS",
    "UnsafeCheckpoint",
    "read_metadata",
    "SafeReader",
    "load_bytes",
    "SafePlanner",
    "load",
    "load_all",
    "check",
]
