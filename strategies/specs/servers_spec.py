"""The parameter-server family (strategies/runtimes/hybrid/): ``hybrid`` (Parallax: Kim et al.,
EuroSys 2019: sparse parameters on sharded parameter servers, dense ones on AllReduce),
``ps`` (every parameter on the servers), and the planner's ``hybrid-cache`` candidate (hybrid
with the workers' hot-row caches, after HET: Miao et al., VLDB 2022; it runs as ``hybrid``
with ``--staleness``)."""
from __future__ import annotations

from hpar.strategies.specs.base import StrategySpec

HYBRID = StrategySpec(
    name="hybrid", summary="Parallax: embedding tables on sharded parameter servers, dense parameters on AllReduce",
    runtime="hpar.strategies.runtimes.hybrid.hybrid_runtime:train",
    estimate="hpar.strategies.plan.costmodel_ps:estimate_hybrid",
    worker_memory="hpar.strategies.plan.memory_model:served_terms",
    evaluate_memory="hpar.strategies.plan.memory_sharded:served_final_terms",
    simplicity=4, servers=True, ddp=True, compress_hooks=True, plain="allreduce",
    sync_batchnorm=True)

HYBRID_CACHE = StrategySpec(
    name="hybrid-cache", summary="hybrid with hot-row caches on the workers (rows read up to s updates stale)",
    runtime=HYBRID.runtime, estimate=None,   # predicted by costmodel_cache.estimate_hybrid_cache, at a staleness
    worker_memory=HYBRID.worker_memory, evaluate_memory=HYBRID.evaluate_memory, simplicity=5, servers=True,
    ddp=True, compress_hooks=True, runs_as="hybrid", sync_batchnorm=True)

PS = StrategySpec(
    name="ps", summary="every parameter on sharded parameter servers (pull, push)",
    runtime="hpar.strategies.runtimes.hybrid.hybrid_runtime:train",
    estimate="hpar.strategies.plan.costmodel_ps:estimate_ps",
    worker_memory="hpar.strategies.plan.memory_model:served_terms",
    evaluate_memory="hpar.strategies.plan.memory_sharded:served_final_terms",
    simplicity=6, servers=True)
