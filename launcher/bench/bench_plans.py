"""One script's plan in ``hpar bench``: the script profiled once, every strategy estimated by
the cost model for the bench's cluster (and a projection's), the planner's plan of each
planned strategy written for its runs, and why a strategy cannot run this job.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.strategies.specs.registry import PIPELINE
from hpar.launcher.bench.bench_config import PLANNED, BenchConfig, bench_entry, row_compress


def not_applicable(name: str, profile, estimates: dict, gpus: int) -> str | None:
    """Why bench strategy ``name`` cannot run this job (None when it can): the model is not a
    sequence of layers, the pipeline's estimate is infeasible (too few layers for the workers),
    torch's schedules meet a traced model, an asynchronous schedule meets a weight tied across
    the planned stages, or torch's schedules or PipeDream-2BW's refuse the planned stages and
    micro-batches (Schedule1F1B needs at least as many micro-batches as stages)."""
    strategy, schedule = bench_entry(name)
    if strategy_spec(strategy).pipelined:
        if not profile.is_sequential:
            return profile.sequential_reason or "not a sequence of layers"
        est = estimates.get(strategy)
        if est is not None and not est.feasible:
            return est.note
        if schedule.startswith("torch-") and profile.traced:
            return (
                "torch.distributed.pipelining's schedules run here on an nn.Sequential or hpar_layers() only; "
                "this model is cut by tracing"
            )
        if est is not None:
            from hpar.strategies.job.tying import stages_of
            from hpar.strategies.plan.stage_cuts import schedule_problem

            problem = schedule_problem(
                {
                    n: stages_of(held, est.stages)
                    for n, held in profile.shared_params
                    if len(stages_of(held, est.stages)) > 1
                },
                schedule,
            )
            if problem:
                return problem.split(": ", 1)[1]
        if schedule == "torch-1f1b" and est is not None and est.micro_batches < gpus:
            return (
                f"the plan's {est.micro_batches} micro-batch(es) per batch are fewer than the {gpus} stages "
                "torch's Schedule1F1B needs (benchmarks/bench_pipeline.py compares it at M = 4)"
            )
        if schedule.startswith("torch-") and est is not None:
            from hpar.strategies.plan.stage_cuts import check_peer

            try:
                check_peer(schedule, len(profile.layers), gpus, est.micro_batches, profile.device)
            except ValueError as exc:
                return str(exc)
        if schedule == "async-2bw" and est is not None:
            from hpar.strategies.specs.pipeline_spec import check_2bw

            try:
                check_2bw(gpus, est.micro_batches)
            except ValueError as exc:
                return str(exc)
    return None


def does_not_fit(name: str, profile, estimates: dict, cluster, steps: int | None = None) -> str | None:
    """Why bench strategy ``name``'s predicted peak memory over ``steps`` steps does not fit
    ``cluster``'s (strategies/plan/memory_model.py: "needs 31.2 GB per worker, 24 GB available"),
    None when it does or has no estimate."""
    from hpar.strategies.plan.memory_model import predict

    strategy, schedule = bench_entry(name)
    est = estimates.get(name if row_compress(name) else strategy)
    if est is None or not est.feasible:
        return None
    return predict(profile, cluster, est, schedule or "1f1b", steps).misfit(cluster) or None


@dataclass(frozen=True)
class ScriptPlan:
    """One script's profile-based view: its batch size, the cost model's estimates for the
    bench's cluster (by cost-model strategy name), those for ``project`` GPUs, and why each
    bench strategy cannot run (name -> reason)."""

    batch_size: int
    estimates: dict
    projected: dict
    reasons: dict
    plan_files: dict = field(default_factory=dict)  # hpar run --strategy -> plan file


def _add_compressed(profile, names: tuple[str, ...], estimates: dict, cluster) -> None:
    """Add to ``estimates`` (by cost-model strategy) each compressed row of ``names`` ("hybrid
    --compress fp16"), by its row name: its strategy's estimate with the AllReduce compressed
    (strategies/plan/costmodel_compress.py)."""
    from hpar.strategies.job.compression import Compression
    from hpar.strategies.plan.costmodel_compress import estimate_compressed

    for n in names:
        base = estimates.get(bench_entry(n)[0])
        if row_compress(n) and base is not None:
            estimates[n] = estimate_compressed(profile, cluster, base, Compression.parse(row_compress(n)))


def plan_script(script: str, cfg: BenchConfig, names: tuple[str, ...], cluster_of, refine=None) -> ScriptPlan:
    """Profile ``script`` once (``profile_job`` for the bench's workers, or the projection's
    when larger, since the union of touched rows is measured per worker count) and estimate
    every strategy on ``cluster_of(gpus)`` (a ClusterSpec factory) with ``estimate_all``;
    ``refine(profile, cluster)``, when given, returns the bench's cluster with what was
    measured for this job (the emulated hosts' sparse exchange). Raises JobError/ValueError
    for a bad script or flags."""
    from hpar.strategies.plan.estimates import estimate_all
    from hpar.strategies.job.contract import check_job, load_job
    from hpar.strategies.plan.memory_model import forward_passes
    from hpar.strategies.profile.profiler import profile_job

    job = load_job(script)
    bs = cfg.batch_size if cfg.batch_size is not None else int(job.defaults.get("batch_size", 32))
    if bs < 1:
        raise ValueError(f"--batch-size must be at least 1, got {bs}")
    check_job(job, bs)
    cluster = cluster_of(cfg.gpus)
    profile = profile_job(job, bs, max(cluster.workers, cfg.project or 0), precision=cfg.precision)
    if refine is not None:
        cluster = refine(profile, cluster)
    estimates = {e.strategy: e for e in estimate_all(profile, cluster)}
    projected = {e.strategy: e for e in estimate_all(profile, cluster_of(cfg.project))} if cfg.project else {}
    # torch's schedules run one pipeline: with them in the bench, hpar's run the same (R = 1) stages
    one_pipeline = 1 if any((bench_entry(n)[1] or "").startswith("torch-") for n in names) else None
    if one_pipeline:
        from hpar.strategies.plan.estimates import estimate_pipeline

        estimates[PIPELINE.name] = estimate_pipeline(profile, cluster, replicas=1)
    _add_compressed(profile, names, estimates, cluster)
    if projected:
        _add_compressed(profile, names, projected, cluster_of(cfg.project))
    reasons = {
        n: why
        for n in names
        if (
            why := not_applicable(n, profile, estimates, cfg.gpus)
            or does_not_fit(n, profile, estimates, cluster, forward_passes(cfg.steps, job.defaults.get("accumulate")))
        )
    }
    # the planner's plan of each planned strategy, so that its runs execute what was
    # predicted (pipeline: stages and micro-batches, one plan for hpar's and torch's schedules
    # alike; hybrid/ps: placement and partitions) rather than each run re-profiling
    from hpar.strategies.state.checkpoint import atomic_write_bytes
    from hpar.strategies.plan.planner import choose_plan

    stem = os.path.splitext(os.path.basename(script))[0]
    # what the predictions were made from, so that a later cost model can be checked on these runs
    atomic_write_bytes(
        os.path.join(os.path.abspath(cfg.bench_dir), f"{stem}-profile.json"),
        json.dumps({"profile": profile.to_dict(), "cluster": dataclasses.asdict(cluster)}).encode(),
    )
    plan_files = {}
    for strategy in sorted({bench_entry(n)[0] for n in names if n not in reasons} & PLANNED):
        path = os.path.join(os.path.abspath(cfg.bench_dir), f"{stem}-{strategy}-plan.json")
        atomic_write_bytes(
            path,
            choose_plan(
                profile,
                cluster,
                force=strategy,
                pipeline_replicas=one_pipeline if strategy_spec(strategy).pipelined else None,
            )
            .to_json()
            .encode(),
        )
        plan_files[strategy] = path
    return ScriptPlan(bs, estimates, projected, reasons, plan_files)


def prediction(estimates: dict, name: str) -> float | None:
    """The cost model's seconds per step for bench strategy ``name`` from ``estimates`` (by
    cost-model strategy; an asynchronous pipeline schedule from its synchronous estimate),
    None where it has none or it is infeasible."""
    from hpar.strategies.plan.estimates import estimate_async_pipeline

    strategy, schedule = bench_entry(name)
    est = estimates.get(name if row_compress(name) else strategy)
    if est is not None and strategy_spec(strategy).pipelined and schedule:
        est = estimate_async_pipeline(est, schedule)
    return est.step_s if est is not None and est.feasible and est.step_s > 0 else None


def projection(plan: ScriptPlan, name: str, gpus: int) -> dict | None:
    """The cost model's projection of bench strategy ``name`` to ``gpus`` GPUs (``step_s`` in
    seconds, ``samples_per_s``, ``bytes_per_step`` per worker, ``note``), None without one."""
    if not plan.projected:
        return None
    est = plan.projected.get(name if row_compress(name) else bench_entry(name)[0])
    if est is None or not est.feasible:
        return {
            "gpus": gpus,
            "projected": True,
            "step_s": None,
            "samples_per_s": None,
            "note": est.note if est is not None else "no estimate",
        }
    return {
        "gpus": gpus,
        "projected": True,
        "step_s": est.step_s,
        "samples_per_s": est.samples_per_s,
        "bytes_per_step": est.bytes_per_step,
        "note": est.note,
    }
