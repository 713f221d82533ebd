"""``allreduce`` and ``allreduce-sparse``: data parallelism with torch's DDP
(strategies/runtimes/dataparallel/allreduce.py). Every worker holds the whole model; gradients are
averaged with AllReduce (Horovod's and DDP's ring), embedding tables' gradients as sparse rows
under ``allreduce-sparse`` (AllGather of the touched rows)."""

from __future__ import annotations

from hpar.strategies.specs.base import StrategySpec

ALLREDUCE = StrategySpec(
    name="allreduce",
    summary="DDP: every worker the whole model, gradients averaged with AllReduce",
    runtime="hpar.strategies.runtimes.dataparallel.allreduce:train",
    estimate="hpar.strategies.plan.costmodel:estimate_allreduce",
    worker_memory="hpar.strategies.plan.memory_model:allreduce_terms",
    simplicity=0,
    ddp=True,
    compress_hooks=True,
    sync_batchnorm=True,
)

ALLREDUCE_SPARSE = StrategySpec(
    name="allreduce-sparse",
    summary="DDP with sparse gradients for embedding tables (AllGather of touched rows)",
    runtime="hpar.strategies.runtimes.dataparallel.allreduce:train",
    estimate="hpar.strategies.plan.costmodel:estimate_allreduce_sparse",
    worker_memory="hpar.strategies.plan.memory_model:sparse_terms",
    simplicity=1,
    ddp=True,
    sparse_gradients=True,
    compress_hooks=True,
    plain="allreduce",
    sync_batchnorm=True,
)
