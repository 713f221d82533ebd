"""The parameter-server family (strategies/runtimes/hybrid/): ``hybrid`` (Parallax: Kim et al.,
EuroSys 2019: sparse parameters on sharded parameter servers, dense ones on AllReduce),
``ps`` (every parameter on the servers), and the planner's ``hybrid-cache`` candidate (hybrid
with the workers' hot-row caches, after HET: Miao et al., VLDB 2022; it runs as ``hybrid``
with ``--staleness``)."""

from __future__ import annotations

from dataclasses import dataclass

from hpar.strategies.specs.base import StrategySpec

HYBRID = StrategySpec(
    name="hybrid",
    summary="Parallax: embedding tables on sharded parameter servers, dense parameters on AllReduce",
    runtime="hpar.strategies.runtimes.hybrid.hybrid_runtime:train",
    estimate="hpar.strategies.plan.costmodel_ps:estimate_hybrid",
    worker_memory="hpar.strategies.plan.memory_model:served_terms",
    evaluate_memory="hpar.strategies.plan.memory_sharded:served_final_terms",
    cluster_probe="hpar.strategies.runtimes.hybrid.request_probe:probe_requests",
    simplicity=4,
    servers=True,
    ddp=True,
    compress_hooks=True,
    plain="allreduce",
    sync_batchnorm=True,
)

HYBRID_CACHE = StrategySpec(
    name="hybrid-cache",
    summary="hybrid with hot-row caches on the workers (rows read up to s updates stale)",
    runtime=HYBRID.runtime,
    estimate=None,  # predicted by costmodel_cache.estimate_hybrid_cache, at a staleness
    worker_memory=HYBRID.worker_memory,
    evaluate_memory=HYBRID.evaluate_memory,
    simplicity=5,
    servers=True,
    ddp=True,
    compress_hooks=True,
    runs_as="hybrid",
    sync_batchnorm=True,
)

PS = StrategySpec(
    name="ps",
    summary="every parameter on sharded parameter servers (pull, push)",
    runtime="hpar.strategies.runtimes.hybrid.hybrid_runtime:train",
    estimate="hpar.strategies.plan.costmodel_ps:estimate_ps",
    worker_memory="hpar.strategies.plan.memory_model:served_terms",
    evaluate_memory="hpar.strategies.plan.memory_sharded:served_final_terms",
    simplicity=6,
    servers=True,
)


# The servers' runtime sizes and settings, here so that the planner's cost and memory models read
# the values the runtime (strategies/runtimes/hybrid/) uses, without importing it.
# Hot-row caches (--cache-rows, --staleness; strategies/runtimes/hybrid/cache.py):
REFRESH_STEPS = 100  # steps between the choices of the cached rows
DEFAULT_FRACTION = 0.1  # --cache-rows when --staleness is given alone: a tenth of each table's rows


@dataclass(frozen=True)
class CacheConfig:
    """``--cache-rows`` (``rows``: >= 1 rows of each cached table, in (0, 1) a fraction of its
    rows, 0 the default fraction) and ``--staleness`` s."""

    rows: float
    staleness: int

    def rows_for(self, table_rows: int) -> int:
        """The cache's capacity for a table of ``table_rows`` rows (at least 1, at most all)."""
        want = self.rows or DEFAULT_FRACTION
        n = int(want) if want >= 1 else int(round(want * table_rows))
        return max(1, min(n, table_rows))


# Row partitions (strategies/runtimes/hybrid/shard.py): the partitions per server of an embedding
# table without a planned count (the finest count the planner tries, strategies/plan/costmodel_ps.py). With one per server, lm.py's frequency-sorted
# vocabulary on 8 servers puts 5.3x the mean touched rows on the busiest one (the profile's
# estimate); with 64, 1.3x (1.33x measured over 40 steps of 8 workers; BENCHMARKS.md 14).
ROW_PARTITIONS_PER_SERVER = 64
# The wire (strategies/runtimes/hybrid/wire.py):
INLINE_MAX = 4 << 20  # bytes of payload carried in the request message itself
INBOX_DEPTH = 8  # a server's receives posted per worker (one buffer of INLINE_MAX each)


# Served tables up to this many bytes in all are pulled whole into evaluate()'s copy, so that
# an evaluate() reading a table's .weight directly (examples/lm.py's full softmax) sees it;
# larger ones stay served row by row, so that no process ever holds them whole (issue 48).
EVAL_WHOLE_BYTES = 1 << 30
