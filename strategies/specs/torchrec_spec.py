"""``torchrec``: the user's embedding tables sharded by TorchRec's DistributedModelParallel
(strategies/runtimes/torchrec/), the rest of the model in DDP. TorchRec exchanges the ids and the looked-up
or pooled rows by all-to-all (table-, row- or column-wise shards; Ivchenko et al., "TorchRec: a
PyTorch domain library for recommendation systems", RecSys 2022) where hybrid pulls and pushes
rows from parameter servers. It needs the optional TorchRec install (scripts/install_torchrec.sh).

``torchrec`` takes the sharding TorchRec's planner chooses; ``torchrec-tw``, ``torchrec-rw`` and
``torchrec-cw`` shard every table one way (:data:`SHARDINGS`), for ``hpar bench`` to compare.
Their cost model is strategies/plan/costmodel_torchrec.py; the planner lists them as not
runnable, with ``check_available``'s one line, where TorchRec is not installed.
"""

from __future__ import annotations

from hpar.strategies.specs.base import StrategySpec

# strategy name -> TorchRec sharding type of every table (None: the planner's choice)
SHARDINGS = {"torchrec": None, "torchrec-tw": "table_wise", "torchrec-rw": "row_wise", "torchrec-cw": "column_wise"}


def _check(cfg) -> str | None:
    """What the torchrec runtime cannot honour yet (one line naming the flag)."""
    name = f"--strategy {cfg.strategy}"
    if cfg.precision != "fp32":
        return (
            f"--precision {cfg.precision} is not supported with {name} (TorchRec's CPU kernels and fused "
            "optimizer here run fp32 tables); drop --precision"
        )
    if cfg.accumulate > 1:
        return (
            f"--accumulate {cfg.accumulate} is not supported with {name}: its fused optimizer updates the tables "
            "in every backward; use a larger --batch-size"
        )
    if cfg.clip_grad_norm:
        return (
            f"--clip-grad-norm is not supported with {name}: the tables' gradients never exist outside its fused "
            "backward update; drop the flag"
        )
    return None


def _spec(name: str, summary: str, simplicity: int) -> StrategySpec:
    estimate = "hpar.strategies.plan.costmodel_torchrec:estimate_" + name.replace("-", "_")
    return StrategySpec(
        name=name,
        summary=summary,
        runtime="hpar.strategies.runtimes.torchrec.trec_runtime:train",
        estimate=estimate,
        worker_memory="hpar.strategies.runtimes.torchrec.trec_memory:torchrec_terms",
        simplicity=simplicity,
        ddp=True,
        check=_check,
        check_available="hpar.strategies.runtimes.torchrec.trec_check:check_available",
        check_model="hpar.strategies.runtimes.torchrec.trec_check:check_model",
    )


TORCHREC = _spec(
    "torchrec",
    "TorchRec: tables sharded by DistributedModelParallel (its planner's choice), "
    "all-to-all of pooled rows, the rest in DDP",
    9,
)  # after -tw/-rw/-cw: on a tie auto runs the costed one
TORCHREC_TW = _spec("torchrec-tw", "TorchRec with every table whole on one worker (table-wise)", 8)
TORCHREC_RW = _spec("torchrec-rw", "TorchRec with every table's rows split over the workers (row-wise)", 8)
TORCHREC_CW = _spec("torchrec-cw", "TorchRec with every table's columns split over the workers (column-wise)", 8)


COLUMN_MULTIPLE = (
    4  # FBGEMM's table-batched kernels hold rows of a multiple of 4 columns (_assert_local_cols_divisible_by_4)
)
MIN_CW_COLUMNS = 128  # TorchRec planner's narrowest column shard unless told otherwise (MIN_CW_DIM)


def column_shard_width(dim: int, world_size: int) -> int | None:
    """The narrowest column-wise shard hpar allows a ``dim``-wide table: ``dim / world_size``
    where that is a multiple of 4 (FBGEMM's row alignment), so that ``torchrec-cw`` splits a
    narrow table over the workers (TorchRec's default, :data:`MIN_CW_COLUMNS`, would keep a
    32-wide table whole); None (TorchRec's default) otherwise."""
    part = dim // world_size
    return part if world_size > 1 and dim % world_size == 0 and part % COLUMN_MULTIPLE == 0 else None


def column_shards(dim: int, world_size: int) -> int:
    """How many column shards TorchRec cuts a ``dim``-wide table into under ``torchrec-cw`` on
    ``world_size`` workers: ``dim / width`` for the smallest width at least
    :func:`column_shard_width` (else :data:`MIN_CW_COLUMNS`) that divides ``dim`` and is a
    multiple of 4, else 1 (the table whole), as torchrec.distributed.sharding_plan's
    ``_get_block_size_for_cw_shard`` decides. recsys.py's 16-wide tables on 8 workers: 1."""
    low = column_shard_width(dim, world_size) or MIN_CW_COLUMNS
    width = next((w for w in range(low, dim) if dim % w == 0 and w % COLUMN_MULTIPLE == 0), dim)
    return dim // min(width, dim)
