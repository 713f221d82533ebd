"""Gathering small values among a run's processes as tensors, never as pickles.

torch's ``*_object`` collectives (``all_gather_object``, ``gather_object``) pickle what each
process sends and unpickle what the others send: whoever can take a peer's place on the
group's connections runs code in every receiver (the torch.distributed docs warn that they use
pickle, "known to be insecure"; torch's SECURITY.md: the collectives are not built for
untrusted networks). hpar sends what it gathers as plain tensors instead:

- numbers: an int64 tensor per process (:func:`all_gather_ints`);
- a JSON document (dicts of numbers, strings, lists, None; what the runtimes report per
  process): its UTF-8 bytes in a uint8 tensor, padded to the longest, its length gathered
  first (:func:`all_gather_json`, :func:`gather_json`);
- a state dict: the entries' names, dtypes and shapes as JSON and their raw bytes as one
  uint8 tensor (:func:`gather_state_dicts`).

Tensors live where the group's backend wants them: on the CPU for gloo (every group these
helpers are used on: strategies/common/groups.py), on the current CUDA device for NCCL. Every
helper is a collective: every member of ``group`` calls it, in the same order.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def _device(group) -> torch.device:
    """Where ``group``'s backend takes tensors: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_ints(values: "list[int] | tuple[int, ...]", group=None) -> list[list[int]]:
    """Every member's ``values`` (the same count on every member; int64 range), in group rank
    order: an AllGather of one int64 tensor each. Returns ``[values of rank 0, ...]``."""
    device = _device(group)
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [p.tolist() for p in parts]


def _encode(document) -> bytes:
    return json.dumps(document, allow_nan=True).encode("utf-8")


def _padded(data: bytes, group) -> tuple[torch.Tensor, list[int]]:
    """``data`` as a uint8 tensor padded to the longest member's, and every member's length."""
    lengths = [n for (n,) in all_gather_ints([len(data)], group)]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.to(_device(group)), lengths


def _all_gather_bytes(data: bytes, group) -> list[bytes]:
    buf, lengths = _padded(data, group)
    parts = [torch.empty_like(buf) for _ in lengths]
    dist.all_gather(parts, buf, group=group)
    return [bytes(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, lengths)]


def _gather_bytes(data: bytes, group, group_dst: int) -> "list[bytes] | None":
    buf, lengths = _padded(data, group)
    here = dist.get_rank(group) == group_dst
    parts = [torch.empty_like(buf) for _ in lengths] if here else None
    dist.gather(buf, parts, group=group, group_dst=group_dst)
    return [bytes(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, lengths)] if here else None


def all_gather_json(document, group=None) -> list:
    """Every member's ``document`` (anything ``json.dumps`` takes: tuples come back as lists,
    NaN as NaN), in group rank order. Raises TypeError for a value JSON cannot hold."""
    return [json.loads(b) for b in _all_gather_bytes(_encode(document), group)]


def gather_json(document, group=None, group_dst: int = 0) -> "list | None":
    """Every member's ``document`` (as :func:`all_gather_json`) on the member of group rank
    ``group_dst``, in group rank order; None on the others."""
    parts = _gather_bytes(_encode(document), group, group_dst)
    return None if parts is None else [json.loads(b) for b in parts]


def _dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` ("float32"); refuses any other attribute of torch."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def gather_state_dicts(state: dict, group=None, group_dst: int = 0) -> "list[dict] | None":
    """Every member's ``state`` (a state dict: name -> tensor; entries that are not tensors
    must be JSON values) on the member of group rank ``group_dst``, as CPU tensors of the same
    dtypes and shapes, in group rank order; None on the others. The names, dtypes and shapes
    travel as JSON, the tensors' bytes as one uint8 tensor per member."""
    entries, chunks, other = [], [], {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            other[name] = value
            continue
        flat = value.detach().cpu().contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        entries.append([name, str(value.dtype).removeprefix("torch."), list(value.shape), raw.numel()])
        chunks.append(raw)
    header = gather_json({"tensors": entries, "other": other, "order": list(state)}, group, group_dst)
    data = torch.cat(chunks).numpy().tobytes() if chunks else b""
    blobs = _gather_bytes(data, group, group_dst)
    if header is None:
        return None
    out = []
    for head, blob in zip(header, blobs):
        part, offset = {}, 0
        raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
        for name, dtype, shape, nbytes in head["tensors"]:
            part[name] = raw[offset : offset + nbytes].clone().view(_dtype(dtype)).reshape(shape)
            offset += nbytes
        assert offset == len(blob), (offset, len(blob))
        part.update(head["other"])
        out.append({name: part[name] for name in head["order"]})
    return out
