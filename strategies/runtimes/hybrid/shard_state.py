"""A parameter server's tables in the run's checkpoints (strategies/state/state.py's namespace).

A server holds partitions ``p, p+S, p+2S, ...`` of a table (``shard.RowLayout``): row ranges
that are not adjacent. Each table is written as torch's ``ShardedTensor`` of the parameter's
own shape (an nn.Embedding's ``(rows, dim)``, a bias's ``(n,)``), one shard per partition at
its row offset, under ``model.<name>``, the key a data-parallel run writes the same parameter
under; its optimizer slots likewise under ``optim.state.<name>.<slot>`` (torch.optim's slot
names, which the servers' updates use: ``momentum_buffer``, ``sum``, ``exp_avg``,
``exp_avg_sq``) and the update count under ``optim.state.<name>.step``; with the workers'
hot-row caches, the rows' versions (update counts, strategies/runtimes/hybrid/versions.py) likewise under
``cache.<name>.version``, so a resumed run goes on counting where it stopped. A load asks for the
rows this server holds in its own layout, so a run resumes with another number of servers or
partitions (DCP reads each shard's overlap with what was saved), and ``hpar export`` reads the
whole table.

``ShardedTensor`` is built from the local shards and the whole table's metadata
(``_init_from_local_shards_and_global_metadata``), which every server can compute from the
layout: no collective among servers and workers is needed to describe a table.
"""

from __future__ import annotations

import math

import torch
import torch.distributed
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

SLOTS = {"sgd": ("momentum_buffer",), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq")}


def row_sharded(
    shape: tuple[int, ...], layout, server: int, local: torch.Tensor, pg_rank_of
) -> ShardedTensor | torch.Tensor:
    """``local`` (this server's rows of the table view, ``(local_rows, dim)``, in layout order)
    as a ShardedTensor of the parameter's ``shape``, its shards being views of ``local`` (a
    load fills ``local`` in place). ``pg_rank_of(server)``: that server's default-group rank.
    A 0-dimensional parameter (one row, one server) is ``local`` reshaped, not sharded."""
    if len(shape) == 0:
        return local.view(())
    bounds = layout.bounds().tolist()
    rest = list(shape[1:])
    me = torch.distributed.get_rank()  # this server's default-group rank (pg_rank_of(server) in a run)
    metas, shards, offset = [], [], 0
    for p in range(layout.num_partitions):
        a, b = bounds[p], bounds[p + 1]
        owner = int(layout._server_of_partition(torch.tensor(p)))
        meta = ShardMetadata(
            [a] + [0] * len(rest), [b - a] + rest, f"rank:{me if owner == server else pg_rank_of(owner)}/cpu"
        )
        metas.append(meta)
        if owner == server:
            shards.append(Shard(local[offset : offset + b - a].view(b - a, *rest), meta))
            offset += b - a
    assert offset == local.shape[0], (offset, local.shape)
    props = TensorProperties(
        dtype=local.dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(metas, torch.Size(shape), props), process_group=None
    )


def server_entries(
    tables: dict,
    shards: dict,
    server: int,
    pg_rank_of,
    keys: set[str] | None = None,
    aliases: dict[str, list[str]] | None = None,
) -> dict:
    """This server's tables and optimizer slots in the checkpoint namespace. ``keys``: for a
    load, the checkpoint's keys (a slot is asked for only where it was saved, and a slot the
    shard has not made yet is made, zero, to be filled). ``aliases``: a table's other names in
    the model's state_dict (a tied weight: ``out.weight`` for ``emb.weight``), written too
    (not read: the first name is)."""
    out = {}
    for tid, shard in shards.items():
        t = tables[tid]
        out[f"model.{t.name}"] = row_sharded(t.shape, t.layout, server, shard.weight, pg_rank_of)
        for other in (aliases or {}).get(t.name, []) if keys is None else []:
            out[f"model.{other}"] = row_sharded(t.shape, t.layout, server, shard.weight, pg_rank_of)
        for slot in SLOTS[t.spec.kind]:
            key = f"optim.state.{t.name}.{slot}"
            if keys is None and slot not in shard.state:
                continue
            if keys is not None:
                if not any(k.startswith(key) for k in keys):
                    continue
                shard._state(slot)
            out[key] = row_sharded(t.shape, t.layout, server, shard.state[slot], pg_rank_of)
        version_key = f"cache.{t.name}.version"
        if shard.versions is not None and (keys is None or version_key in keys):
            out[version_key] = row_sharded((t.rows,), t.layout, server, shard.versions, pg_rank_of)
        step_key = f"optim.state.{t.name}.step"
        if keys is None or step_key in keys:
            out[step_key] = torch.tensor(float(shard.step))
    return out


def set_steps(tables: dict, shards: dict, entries: dict) -> None:
    """After a load: each shard's update count from its ``optim.state.<name>.step``."""
    for tid, shard in shards.items():
        key = f"optim.state.{tables[tid].name}.step"
        if key in entries:
            shard.step = int(math.floor(float(entries[key])))


__all__ = ["row_sharded", "server_entries", "set_steps", "SLOTS"]
