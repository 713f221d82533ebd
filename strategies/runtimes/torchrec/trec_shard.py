"""TorchRec's DistributedModelParallel over the swapped tables (trec_tables.py): the fused
optimizer, the sharding plan under a deadline, the user's initial rows in the shards.

:func:`shard` runs the steps of TorchRec's own recipe (its DLRM example and
``DistributedModelParallel``'s docstring):

1. ``apply_optimizer_in_backward(<the script's optimizer class>, tables, <its options>)``: the
   tables' rows are updated inside backward by FBGEMM's table-batched kernel, exactly
   (``exact_sgd``, ``exact_adagrad``; trec_optim.py maps the script's optimizer);
2. the plan: every worker runs TorchRec's ``EmbeddingShardingPlanner`` (its own choice, or
   every table of one sharding type for ``torchrec-tw/-rw/-cw``) on the same model, and the
   workers compare their plans' digests and errors as JSON in tensors over the gloo control
   group (TorchRec's ``collective_plan`` broadcasts a pickled plan from rank 0, and leaves the
   peers waiting forever where its planner raised on rank 0 only); a refusal ends every worker
   with the same one line;
3. ``DistributedModelParallel``: the tables sharded as planned (all-to-all of ids and pooled
   rows; data-parallel tables AllReduced), the rest of the model wrapped in DDP over the same
   group; gradients are averaged over the workers (TorchRec's ``GRADIENT_DIVISION``, on by
   default, divides the all-to-all's gradients by the world size as DDP does);
4. :func:`load_tables`: every shard gets its rows of the user's initial table, so the run
   starts where one process would.

Row-wise sharding on CPU: TorchRec's stock sharder offers ``row_wise`` for CUDA only
(``BaseEmbeddingSharder.sharding_types``); :class:`CpuRowWiseSharder` offers it on CPU too,
where its kernels run unchanged (gloo's reduce-scatter and all-gather).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hpar.strategies.runtimes.torchrec.trec_tables import SwappedTable, TorchrecTable
from hpar.strategies.specs.torchrec_spec import column_shard_width


def _sharder():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    class CpuRowWiseSharder(EmbeddingBagCollectionSharder):
        """The stock sharder, with ``row_wise`` offered on CPU as on CUDA (module docstring)."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            kinds = list(super().sharding_types(compute_device_type))
            return kinds + ["row_wise"] if compute_device_type == "cpu" and "row_wise" not in kinds else kinds

    return CpuRowWiseSharder()


def quiet() -> None:
    """Silence the notices TorchRec and torch print on this path that ask nothing of the user
    (the planner's topology and storage-reservation warnings, DDP's ``broadcast_buffers`` and
    gloo's reduce-scatter/all-gather deprecations, ``is_fx_tracing``); errors still show."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.|torch\.distributed\.c10d_logger")
    for name in ("torchrec.distributed.planner", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)


def table_modules(model: nn.Module) -> list[TorchrecTable]:
    """The TorchrecTable modules of ``model``, in model order."""
    return [m for m in model.modules() if isinstance(m, TorchrecTable)]


def plan_on_every_worker(
    model: nn.Module, sharders: list, sharding: str | None, world_size: int, device: torch.device, control
) -> object:
    """The ShardingPlan of ``model``'s tables: every worker runs TorchRec's
    ``EmbeddingShardingPlanner`` (``Topology(world_size, compute_device)``; every table
    constrained to ``sharding`` when given) on the same model, so all make the same plan without
    its collective broadcast (a pickle, and a wait forever where the planner raised on rank 0
    only); the workers then compare their plans' digests and errors, as JSON in tensors over
    ``control`` (strategies/common/gather.py). Raises ValueError (one line) on every worker when
    any failed or their plans differ."""
    import hashlib
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from hpar.strategies.common.gather import all_gather_json

    plan, mine = None, {"error": "", "digest": ""}
    try:
        constraints = None
        if sharding is not None:
            constraints = {
                t.table.key: ParameterConstraints(
                    sharding_types=[sharding], min_partition=column_shard_width(t.table.dim, world_size)
                )
                for t in table_modules(model)
            }
        topology = Topology(world_size=world_size, compute_device=device.type)
        plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).plan(model, sharders)
        mine["digest"] = hashlib.sha256(str(plan).encode()).hexdigest()
    except Exception as exc:  # noqa: BLE001 - whatever TorchRec's planner raises, every worker must hear it
        mine["error"] = f"TorchRec's planner: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    everyone = all_gather_json(mine, group=control)
    errors = [e["error"] for e in everyone if e["error"]]
    if errors:
        hint = f" (--strategy torchrec-{sharding[:1]}w asks for {sharding})" if sharding else ""
        raise ValueError(f"{errors[0]}{hint}; try --strategy torchrec, the planner's own choice")
    if len({e["digest"] for e in everyone}) > 1:
        raise ValueError(
            "TorchRec's planner made different plans on the workers; try --strategy torchrec-tw, a fixed sharding"
        )
    return plan


def _local_slices(value) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """``[(local tensor, its offsets in the whole table)]`` of a state_dict value: the local
    shards of a ShardedTensor, the local part of a DTensor, or a whole (replicated) tensor."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]
    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return [(value.to_local(), tuple(offsets))]
    return [(value, (0, 0))]


def table_key(table: SwappedTable) -> str:
    """The state_dict key of ``table``'s rows in the sharded model."""
    prefix = f"{table.module}." if table.module else ""
    return f"{prefix}collection.embedding_bags.{table.key}.weight"


@torch.no_grad()
def load_tables(dmp, tables: list[SwappedTable], weights: dict[str, torch.Tensor]) -> None:
    """Copy each table's rows of ``weights`` (the user's parameter name -> the whole
    ``(rows, dim)`` table, on every worker) into this worker's shards of it, in place."""
    state = dmp.state_dict()
    for t in tables:
        whole = weights[t.weight]
        for local, (r, c) in _local_slices(state[table_key(t)]):
            local.copy_(whole[r : r + local.shape[0], c : c + local.shape[1]].to(local.device))


@torch.no_grad()
def gather_tables(dmp, tables: list[SwappedTable], control) -> dict[str, torch.Tensor]:
    """The whole ``(rows, dim)`` table of each of ``tables`` (the user's parameter name ->
    CPU tensor), assembled from every worker's shards: a collective over ``control`` (every
    worker calls it; each gets the tables). Which slices each worker holds travels as JSON in
    tensors (strategies/common/gather.py, never a pickle); the lowest rank holding a slice
    (replicated tables: rank 0) writes it into a zero table, and an AllReduce sums them."""
    from hpar.strategies.common.gather import all_gather_json

    state = dmp.state_dict()
    mine = {t.weight: _local_slices(state[table_key(t)]) for t in tables}
    held = all_gather_json(
        {w: [[*offsets, *local.shape] for local, offsets in parts] for w, parts in mine.items()}, group=control
    )
    me, out = dist.get_rank(control), {}
    for t in tables:
        parts = mine[t.weight]
        whole = torch.zeros(t.rows, t.dim, dtype=parts[0][0].dtype if parts else torch.float32)
        for local, (r, c) in parts:
            if not any([r, c, *local.shape] in held[k][t.weight] for k in range(me)):
                whole[r : r + local.shape[0], c : c + local.shape[1]] = local.detach().cpu()
        dist.all_reduce(whole, group=control)
        out[t.weight] = whole
    return out


def shard(
    model: nn.Module,
    fused: tuple[type, dict],
    sharding: str | None,
    groups,
    device: torch.device,
    find_unused: bool = False,
):
    """``model`` (tables swapped, on ``meta``) in DistributedModelParallel over
    ``groups.dense`` with ``fused`` = ``(optimizer class, options)`` applied in backward to
    its tables (module docstring, steps 1-3), the rest in DDP with ``find_unused_parameters``
    = ``find_unused`` (``--find-unused-parameters``). Returns the DMP module. Raises
    ValueError (one line, on every worker) when no plan could be made."""
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    opt_class, options = fused
    params = [p for m in table_modules(model) for p in m.collection.parameters()]
    apply_optimizer_in_backward(opt_class, params, dict(options))  # it adds keys of its own
    sharders = [_sharder()]
    world = dist.get_world_size(groups.dense)
    plan = plan_on_every_worker(model, sharders, sharding, world, device, groups.control)
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(groups.dense),
        device=device,
        plan=plan,
        sharders=sharders,
        data_parallel_wrapper=DefaultDataParallelWrapper(
            static_graph=not find_unused, find_unused_parameters=find_unused
        ),
    )
