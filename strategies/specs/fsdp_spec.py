"""``fsdp``: fully sharded data parallelism with torch's FSDP2 (``fully_shard``,
strategies/runtimes/dataparallel/fsdp.py): parameters, gradients and optimizer state sharded over the
workers, gathered per unit for its forward and backward (Zhao et al., "PyTorch FSDP", VLDB
2023)."""

from __future__ import annotations

from hpar.strategies.specs.base import StrategySpec


def _check(cfg) -> str | None:
    """fp16 needs one inf/NaN check over every shard, which FSDP2's gradient scaler lacks."""
    if cfg.precision == "fp16":
        return (
            "--precision fp16 is not supported with --strategy fsdp (its gradient scaler's inf/NaN check would "
            "span the shards); use --precision bf16"
        )
    return None


FSDP = StrategySpec(
    name="fsdp",
    summary="FSDP2: parameters, gradients and optimizer state sharded over the workers",
    runtime="hpar.strategies.runtimes.dataparallel.fsdp:train",
    estimate="hpar.strategies.plan.costmodel_fsdp:estimate_fsdp",
    worker_memory="hpar.strategies.plan.memory_sharded:fsdp_terms",
    evaluate_memory="hpar.strategies.plan.memory_sharded:fsdp_final_terms",
    check_available="hpar.strategies.runtimes.dataparallel.fsdp:check_available",
    profile_probe="hpar.strategies.runtimes.dataparallel.fsdp_cost:fsdp_overhead_s",
    simplicity=3,
    check=_check,
    unused_by_rank=False,
    sync_batchnorm=True,
)  # FSDP2: plan/costmodel_fsdp.UNUSED_BY_RANK
