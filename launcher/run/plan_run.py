"""The planner as ``hpar run`` uses it: profile the job, describe the cluster, choose a plan."""

from __future__ import annotations

import dataclasses

from hpar.strategies.specs.decision import Plan
from hpar.strategies.specs.registry import HYBRID_CACHE


def plan_job(
    job,
    batch_size: int,
    hosts_spec: str | None,
    gpus: int,
    flags=None,
    precision: str | None = None,
    capacity=None,
    cache=None,
    forwards: int | None = None,
) -> tuple[Plan, object]:
    """Profile ``job`` (strategies/profile/profiler.py) for ``gpus`` workers on the hosts of
    ``hosts_spec`` (link figures probed on this machine, or hpar profile's defaults for remote
    hosts) and return the planner's Plan (strategies/plan/planner.py) and the Profile it was
    made from. ``flags`` (launcher/run/flags.PlanFlags; None: the defaults): ``strategy`` other
    than auto plans that one (``force``: even when it exceeds ``capacity``), ``servers``,
    ``schedule`` (default 1f1b), ``pipeline_replicas`` (the pipeline's R fixed) and ``device``:
    the profile measures on this machine's GPU unless it is ``cpu`` or there is none; the plan's
    ``compute`` says which, and ``hpar run`` warns when its workers use another device
    (:func:`compute_mismatch`). ``precision``: the workers' ``--precision`` (None: the
    script's), under which the forward passes are timed; ``capacity``: the memory each process
    may use (strategies/plan/capacity.py); ``cache``: the hot-row caches the user allowed
    (``--staleness``: hybrid/cache.CacheConfig), which the planner may then choose;
    ``forwards``: each worker's forward passes over the run (its memory's growth). A plan of
    ``auto`` lists under ``alternatives`` the other strategies' plans that fit, for ``--tune``.
    Raises JobError/ValueError."""
    from hpar.launcher.run.flags import PlanFlags

    flags = flags or PlanFlags()
    force = None if flags.strategy == "auto" else flags.strategy
    from hpar.strategies.job.compression import Compression  # auto weighs the user's --compress (planner.choose_plan)

    compress = Compression.parse(flags.compress) if flags.compress is not None and force is None else None
    schedule, pipeline_replicas = flags.schedule or "1f1b", flags.pipeline_replicas
    from hpar.launcher.run.cluster_build import build_cluster
    from hpar.strategies.plan.vet import vetted_plan
    from hpar.strategies.plan.planner import choose_plan
    from hpar.strategies.profile.profiler import profile_job, skipped_for
    from hpar.strategies.profile.device import profile_device

    measure_on = profile_device("cpu" if flags.device == "cpu" else "auto")
    cluster = build_cluster(
        gpus, hosts_spec, flags.servers, None, None, None, measured_on=measure_on.type, capacity=capacity
    )
    skip = skipped_for(force, cache is not None)  # a forced strategy: only what its plan reads
    profile = profile_job(
        job, batch_size, cluster.workers, device=measure_on, precision=precision, compress=compress, skip=skip
    )
    # no candidate that `hpar run` would refuse before start is chosen (strategies/plan/vet.py)
    plan = vetted_plan(
        job,
        profile,
        cluster,
        needs=flags.needs,
        settings=flags.settings,
        schedule=schedule,
        force=force,
        pipeline_replicas=pipeline_replicas,
        allow_misfit=flags.force,
        cache=cache,
        forwards=forwards,
        compress=compress,
    )
    if force is not None:
        return plan, profile
    alternatives = {}  # the plans --tune may try (strategies/plan/tuning.py): those that fit
    for c in plan.candidates:
        if c.available and c.strategy != (HYBRID_CACHE.name if plan.cache else plan.strategy):
            try:
                alt = choose_plan(
                    profile,
                    cluster,
                    schedule=schedule,
                    force=c.strategy,
                    pipeline_replicas=pipeline_replicas,
                    cache=cache,
                    forwards=forwards,
                )
            except ValueError:
                continue
            alternatives[c.strategy] = {k: v for k, v in alt.to_dict().items() if k != "candidates"}
    return dataclasses.replace(plan, alternatives=alternatives), profile


def compute_mismatch(plan: Plan, device: str) -> str | None:
    """One line for ``hpar run`` when the plan's compute times were measured on another device
    than its workers use (a CPU profile for GPU workers); None otherwise (no profile behind the
    plan, a projection, or the same device)."""
    source = plan.compute or ""
    if not source.startswith("measured on ") or source == f"measured on {device}":
        return None
    return (
        f"warning: the plan's compute times were {source}, the workers run on {device}; for a plan measured on "
        f"the workers' device run `hpar profile --device {device} --plan-out plan.json` there and "
        "`hpar run --plan plan.json`"
    )
