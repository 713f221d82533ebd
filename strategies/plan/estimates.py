"""Every strategy's estimate in one place: the data-parallel formulas of costmodel.py, the
parameter servers' (costmodel_ps.py), the pipelines' (costmodel_pipeline.py: a synchronous
schedule, and asynchronous 1F1B on its stages) and FSDP's (costmodel_fsdp.py). The planner and
``hpar bench`` call these; the strategy modules import only costmodel.py's shared terms, so
the imports run one way (costmodel <- costmodel_* <- estimates).
"""

from __future__ import annotations

from hpar.strategies.specs.registry import PIPELINE, strategies
from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.costmodel import Estimate
from hpar.strategies.plan.costmodel_pipeline import estimate_pipeline_grid
from hpar.strategies.profile.records import Profile


def estimate_pipeline(
    profile: Profile, cluster: ClusterSpec, schedule: str = "1f1b", replicas: int | None = None
) -> Estimate:
    """``pipeline``: the fastest synchronous plan of K stages x R replicas = N workers
    (``replicas``: only that R), its layout and M micro-batches; the formulas, with sources,
    are in costmodel_pipeline.py. With R = 1 it is the plain pipeline:
    (M + K - 1) * slowest stage period (+ 2 messages per micro-batch) + the slowest stage's
    update, a bubble of (K-1)/(M+K-1) (Huang et al., "GPipe", NeurIPS 2019; Narayanan et
    al., "PipeDream", SOSP 2019). Infeasible (note says why) when the model is not a
    sequence of layers or no split fits its layers."""
    return estimate_pipeline_grid(profile, cluster, replicas)


ASYNC_EXTRA_UPDATES = {"async": 0.0, "async-stash": 0.5, "async-predict": 0.5}


def estimate_async_pipeline(sync: Estimate, schedule: str) -> Estimate:
    """Asynchronous 1F1B (PipeDream, SOSP 2019; SpecTrain, arXiv 1809.02839) on the stages
    and M of a synchronous :func:`estimate_pipeline` result: no flush, so no bubble (M stage
    periods per batch instead of M + K - 1), but an optimizer step after every micro-batch
    (M updates per batch instead of one), and per forward a copy of the stage's weights
    (``async-stash``) or one out-of-place pass over the weights and the momentum
    (``async-predict``: W - s lr v), each costed as half an update (a copy or an axpy
    against an SGD-momentum step's several passes over weights, gradient and buffer); with
    replicas, each of the M updates also waits for its replica AllReduce."""
    if not sync.feasible or schedule not in ASYNC_EXTRA_UPDATES:
        return sync
    m, period, update = sync.micro_batches, sync.breakdown["period"], sync.breakdown["update"]
    reduce = sync.breakdown.get("allreduce", 0.0)  # with replicas, every update averages its gradient
    data, host = sync.breakdown.get("data", 0.0), sync.breakdown.get("host", 0.0)
    step = data + host + m * (period + update * (1.0 + ASYNC_EXTRA_UPDATES[schedule]) + reduce)
    return Estimate(
        PIPELINE.name,
        step,
        sync.samples_per_step,
        sync.bytes_per_step,
        {"data": data, "host": host, "period": period, "bubble": 0.0, "update": m * update, "allreduce": m * reduce},
        sync.placement,
        stages=sync.stages,
        micro_batches=m,
        replicas=sync.replicas,
        layout=sync.layout,
    )


def estimate_all(profile: Profile, cluster: ClusterSpec) -> list[Estimate]:
    """Every strategy's :class:`Estimate`, in the registry's order (strategies/specs/registry.py:
    allreduce, allreduce-sparse, hybrid, ps, pipeline, fsdp, then any added ones); strategies
    whose spec names no cost model are left out."""
    return [s.load("estimate")(profile, cluster) for s in strategies() if s.estimate]


__all__ = ["estimate_pipeline", "estimate_async_pipeline", "estimate_all", "ASYNC_EXTRA_UPDATES"]
