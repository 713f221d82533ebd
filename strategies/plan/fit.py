"""Whether ``hpar run``'s plan fits the workers' and servers' memory, decided before anything
starts (``--worker-memory``, ``--server-memory``, ``--force``; strategies/plan/capacity.py).

The peaks are predicted (strategies/plan/memory_model.py) for the run as configured, from the
planner's profile where the planner ran (``auto``, ``pipeline``), else from a memory-only
profile of the model the pre-start check built (strategies/profile/quick.py: one measured
step, no timing): a strategy named without the planner, a ``--plan`` file (a traced model's
pipeline plan keeps the peaks the file carries). The run's own settings count (a pipeline's
``--micro-batches`` and ``--schedule``, the plan's placement and partitions). A plan that does
not fit is refused in one line, unless ``--force``; either way its prediction goes into the
plan's ``memory`` and from there into summary.json beside the measured peaks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.strategies.specs.base import ON_ALLREDUCE
from hpar.strategies.plan.capacity import Capacity, misfit, with_defaults


def run_estimate(cfg, model, profile):
    """The cost model's Estimate shape of the run ``cfg`` (what the memory model reads): its
    placement and partitions (hybrid, ps), stages, micro-batches and replicas (pipeline)."""
    from hpar.strategies.job.forward import inner_module
    from hpar.strategies.plan.placement import placement
    from hpar.strategies.plan.costmodel import Estimate

    plan, spec = cfg.plan, strategy_spec(cfg.strategy)
    if spec.servers:
        where = placement(inner_module(model), cfg.strategy, plan)
    else:
        where = {p.name: ON_ALLREDUCE for p in profile.params}
    stages = ()
    if spec.pipelined and plan.stages:
        stages = tuple(tuple(int(x) for x in r) for r in plan.stages)
    elif spec.pipelined:
        from hpar.strategies.plan.stage_cuts import stage_ranges

        stages = tuple(tuple(r) for r in stage_ranges(model, cfg.pipeline_stages, plan))
    breakdown = {}
    if getattr(cfg, "staleness", None) is not None and plan.cache:  # the workers' hot-row caches
        from hpar.strategies.specs.servers_spec import CacheConfig
        from hpar.strategies.plan.costmodel_cache import cache_bytes

        sizes = {p.name: p for p in profile.params if p.name in (plan.cache.get("hot_rows") or {})}
        config = CacheConfig(cfg.cache_rows, cfg.staleness)
        breakdown["cache_bytes"] = cache_bytes(
            {n: config.rows_for(p.rows) for n, p in sizes.items()},
            {n: p.bytes / max(p.rows, 1) for n, p in sizes.items()},
        )
    return Estimate(
        cfg.strategy,
        0.0,
        0,
        0.0,
        breakdown,
        placement=where,
        partitions=dict(plan.partitions or {}),
        stages=stages,
        micro_batches=cfg.micro_batches,
        replicas=cfg.replicas,
    )


def predict_run(cfg, job, model, profile=None) -> dict | None:
    """The predicted peaks (``MemoryEstimate.to_dict``) of the run ``cfg``, from ``profile``
    (the planner's) or a memory-only profile of ``model`` (module docstring); None for a
    pipeline of a traced model without the planner's profile (its layers need a trace)."""
    import torch
    from hpar.strategies.job.layers import is_declared_sequence
    from hpar.strategies.plan.cluster import make_cluster
    from hpar.strategies.plan.memory_model import forward_passes, predict
    from hpar.strategies.profile.quick import memory_only_profile

    if profile is None:
        if strategy_spec(cfg.strategy).pipelined and not is_declared_sequence(model):
            return None
        on = torch.device("cuda", 0) if cfg.device == "cuda" and torch.cuda.is_available() else torch.device("cpu")
        profile = memory_only_profile(job, model, cfg.batch_size, cfg.world_size, on, cfg.precision)
    cluster = make_cluster(None, cfg.world_size, max(cfg.servers, 1), 1e9, 0.0)
    return predict(
        profile, cluster, run_estimate(cfg, model, profile), cfg.schedule, forward_passes(cfg.steps, cfg.accumulate)
    ).to_dict(None)


def check(memory: dict, capacity: Capacity, strategy: str, force: bool, say) -> None:
    """Refuse (ValueError, one line) a plan whose predicted peaks do not fit ``capacity``,
    unless ``force``, which says so in one line and goes on."""
    from hpar.strategies.plan.memory_model import refusal

    why = misfit(memory, capacity)
    if not why:
        return
    if force:
        say(f"hpar: warning: --strategy {strategy} {why}; running it anyway (--force)")
        return
    raise ValueError(refusal(strategy, why))


def fit_plan(
    say: Callable[[str], None],
    cfg,
    job,
    model,
    given: Capacity,
    workers_on: list[str],
    local: bool,
    force: bool,
    profile=None,
):
    """``cfg`` with the run's predicted peaks in ``cfg.plan.memory`` (:func:`predict_run`),
    checked against ``given`` and, where the run is ``local``, this machine's defaults
    (:func:`check`: refused in one line unless ``force``). ``workers_on``: the host name of
    each worker rank (the busiest host's processes share its memory)."""
    names = list(workers_on) or ["localhost"] * cfg.world_size
    busiest = max(names.count(n) for n in set(names)) + -(-cfg.servers // len(set(names)))
    capacity = with_defaults(given, local, cfg.device, busiest)
    try:
        memory = predict_run(cfg, job, model, profile) or cfg.plan.memory
    except Exception as exc:  # a prediction must not stop a run the pre-start checks passed; say why it is missing
        say(
            f"hpar: warning: no memory prediction for this run ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); it is not checked against the memory"
        )
        memory = cfg.plan.memory
    if memory:
        cfg = cfg.replace(plan=dataclasses.replace(cfg.plan, memory=memory))
        check(memory, capacity, cfg.strategy, force, say)
    return cfg
