"""Choose how to train: the fastest predicted strategy that hpar can run, as a :class:`Plan`.

The :class:`Plan` and its :class:`Candidate` rows are typed values of
strategies/specs/decision.py (what each field means and who reads it); ``hpar profile
--plan-out`` writes ``Plan.to_dict()`` and the run config's ``plan`` field holds the Plan.
A candidate whose predicted peak does not fit the cluster's memory (``--worker-memory``,
``--server-memory``) is listed as not runnable with the one reason, and never chosen; so is one
whose library this install lacks (its spec's ``check_available``: TorchRec's optional install).
"""

from __future__ import annotations

import dataclasses

from hpar.strategies.specs.base import ON_SERVERS
from hpar.strategies.specs.registry import HYBRID, spec as strategy_spec
from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.specs.decision import Candidate, Plan
from hpar.strategies.specs.servers_spec import CacheConfig
from hpar.strategies.plan.costmodel import Estimate
from hpar.strategies.plan.estimates import estimate_all, estimate_pipeline
from hpar.strategies.plan.costmodel_cache import (
    NAME as CACHED,
    SHOWN_STALENESS,
    estimate_hybrid_cache,
    plan_cache,
    profiled,
)
from hpar.strategies.plan.costmodel_compress import shown_rows
from hpar.strategies.plan.costmodel_pipeline import describe as describe_pipeline
from hpar.strategies.plan.memory_model import predict as predict_memory, refusal
from hpar.strategies.plan.pipeline_fit import fitting_layout
from hpar.strategies.plan.plan_reasons import compressed_why, fastest_simplest, plan_reason, tied_note
from hpar.strategies.job.compression import Compression
from hpar.strategies.job.tying import stages_of
from hpar.strategies.plan.stage_cuts import schedule_problem
from hpar.strategies.profile.records import Profile


def compute_source(profile: Profile, cluster: ClusterSpec) -> str:
    """Where the plan's compute times come from: ``"measured on cpu"`` / ``"measured on cuda"``
    (the profile's device), or ``"projected: T TFLOP/s"`` (plus ``", M GB/s"`` with a memory
    bandwidth) when the cluster describes its devices (strategies/plan/roofline.py)."""
    if cluster.device_flops is None:
        return f"measured on {profile.device}"
    mem = f", {cluster.device_mem_Bps / 1e9:g} GB/s" if cluster.device_mem_Bps else ""
    return f"projected: {cluster.device_flops / 1e12:g} TFLOP/s{mem} (from a profile on {profile.device})"


def unavailable(name: str) -> str:
    """Why strategy ``name`` cannot run in this install: its spec's ``check_available`` line (an
    optional library missing or of another version: torchrec), "" when it can or has no check."""
    spec = strategy_spec(name)
    if not spec.check_available:
        return ""
    try:
        spec.load("check_available")()
    except ValueError as exc:
        return str(exc)
    return ""


def _cache_note(e: Estimate, cache: CacheConfig, asked: bool) -> str:
    """The hybrid-cache candidate's note: the cache it was predicted for, and how to allow it."""
    note = (
        f"cache of {cache.rows:g} rows per table"
        if cache.rows >= 1
        else f"cache of {(cache.rows or 0.1):.0%} of each table"
    ) + f", s = {cache.staleness}"
    if e.feasible:
        note += f": {e.breakdown.get('hit_rate', 0):.0%} of lookups hit (predicted)"
    return note if asked else note + "; reads rows up to s updates stale: only with --staleness S"


def choose_plan(
    profile: Profile,
    cluster: ClusterSpec,
    schedule: str = "1f1b",
    force: str | None = None,
    pipeline_replicas: int | None = None,
    allow_misfit: bool = False,
    cache: CacheConfig | None = None,
    forwards: int | None = None,
    refused: dict | None = None,
    compress: Compression | None = None,
) -> Plan:
    """Predict every strategy (``costmodel.estimate_all``) and its peak memory
    (``plan/memory_model.predict``) and pick the highest samples/s among those that fit the job and
    the cluster's memory; the others are still listed as candidates with a note. A hybrid
    plan that places nothing on the servers, or allreduce-sparse without an embedding table, is
    listed but cannot win (it would run as allreduce); predictions within ``TIE`` of the fastest go to the simplest strategy. ``force`` (the user's ``--strategy``) takes that strategy's plan
    instead (its stages, micro-batches, placement); ``pipeline_replicas`` fixes the pipeline's R
    (``--pipeline-replicas``). ``hybrid-cache`` (hybrid with the workers' hot-row caches, HET:
    Miao et al., VLDB 2022) is listed where the profile has row frequencies, at ``cache`` when
    the user gave ``--staleness`` (then it may win, and the plan's ``cache`` says so), else at
    s = ``SHOWN_STALENESS`` and not runnable: staleness trades accuracy, never chosen unasked.
    ``forwards``: the forward passes each worker runs (steps times accumulation), for the
    memory a worker's caches grow to. ``refused``: {strategy: the line ``hpar run`` refuses
    it with} (strategies/plan/vet.py), listed as not runnable with that line. ``compress``: the
    user's ``--compress``; then a strategy with DDP's AllReduce is also a candidate with its
    AllReduce compressed (strategies/plan/costmodel_compress.py) that may win, and the plan's
    ``compress`` says so; without it compressed rows are shown, never chosen. Raises ValueError when no strategy fits, or when the forced one does not fit (its memory
    too, unless ``allow_misfit``: ``hpar run --force``), with the reason."""
    estimates = estimate_all(profile, cluster)
    shown = cache or CacheConfig(0.0, SHOWN_STALENESS)
    if any(p.embedding_module and p.hot_batches for p in profile.params):
        at = next(i for i, e in enumerate(estimates) if e.strategy == HYBRID.name) + 1
        estimates.insert(at, estimate_hybrid_cache(profile, cluster, shown))
    if pipeline_replicas is not None:
        estimates = [
            estimate_pipeline(profile, cluster, replicas=pipeline_replicas)
            if strategy_spec(e.strategy).pipelined
            else e
            for e in estimates
        ]
    estimates = [
        fitting_layout(profile, cluster, e, schedule, forwards, pipeline_replicas)
        if strategy_spec(e.strategy).pipelined
        else e
        for e in estimates
    ]  # the fastest K x R that fits
    candidates, ok, misfits, memory = [], [], {}, {}
    withheld = set(refused or {})  # not installed, or refused before start: never "predicted faster" in the reason
    for e in estimates:
        note = e.note
        available = e.feasible
        if e.strategy == CACHED:
            note = _cache_note(e, shown, cache is not None) + ("; " + note if note else "")
            available = available and cache is not None
        spec = strategy_spec(e.strategy)
        missing = unavailable(e.strategy) if available else ""
        if missing:  # an optional library this install lacks: listed with its one line, never chosen
            note, available = missing, False
            withheld.add(e.strategy)
        if spec.servers and spec.ddp and e.feasible and ON_SERVERS not in e.placement.values():
            trained = [p for p in profile.params if p.embedding_module and not p.frozen]
            why = (
                "every embedding table costs less on AllReduce"
                if trained
                else "every embedding table is frozen (requires_grad=False): nothing to place on servers"
                if any(p.embedding_module for p in profile.params)
                else "no embedding table to place on servers" + tied_note(profile)
            )
            note = (note + "; " if note else "") + f"{why} (same as allreduce)"
            available = False  # it would run as allreduce: never the winner in its own name
        if (
            spec.sparse_gradients
            and e.feasible
            and not any(p.embedding_module and not p.frozen for p in profile.params)
        ):
            note = (
                note + "; " if note else ""
            ) + f"no embedding table to give sparse gradients{tied_note(profile)} (same as allreduce)"
            available = False  # `hpar run` runs it as allreduce
        if spec.pipelined and e.feasible:
            note = describe_pipeline(e) + ("; " + note if note else "")
            problem = schedule_problem(
                {
                    n: stages_of(held, e.stages)
                    for n, held in profile.shared_params
                    if len(stages_of(held, e.stages)) > 1
                },
                schedule,
            )
            if problem:  # a tied weight across stages under an asynchronous schedule (pipeline/ties.py)
                note, available = problem.split(": ", 1)[1], False
        if available and e.strategy in (refused or {}):  # `hpar run` would refuse it before start
            note, available = refused[e.strategy], False
        measured_sparse = [p.name for p in profile.params if p.sparse and not p.embedding_module]
        if spec.servers and spec.ddp and measured_sparse:
            note = (
                note + "; " if note else ""
            ) + f"sparse non-embedding parameters stay on AllReduce: {', '.join(measured_sparse[:3])}"
        mem = predict_memory(profile, cluster, e, schedule, forwards) if e.feasible else None
        memory[e.strategy] = mem
        misfit = mem.misfit(cluster) if mem is not None else ""
        if misfit:  # the one reason it is not runnable (strategies/plan/memory_model.py)
            if available:
                misfits[e.strategy] = misfit  # runnable but for its memory
            note, available = misfit, False
        candidates.append(
            Candidate(
                e.strategy,
                e.step_s,
                e.samples_per_s,
                e.bytes_per_step,
                available,
                note,
                dict(e.breakdown),
                mem.to_dict(cluster) if mem is not None else {},
            )
        )
        if available:
            ok.append(e)
    candidates, runnable = shown_rows(
        profile,
        cluster,
        estimates,
        candidates,  # --compress's rows (costmodel_compress)
        lambda ce: predict_memory(profile, cluster, ce, schedule, forwards),
        compress,
    )
    compressed = {id(ce): c for ce, c in runnable}
    if force is not None:
        forced = [e for e in estimates if e.strategy == force]
        if not forced or not forced[0].feasible:
            why = forced[0].note if forced else "unknown strategy"
            raise ValueError(f"--strategy {force} does not fit this job: {why}")
        if force in misfits and not allow_misfit:
            raise ValueError(refusal(force, misfits[force]))
        best = forced[0]
    elif not ok:
        raise ValueError(
            "no strategy fits this job" + (": " + "; ".join(f"{k} {v}" for k, v in misfits.items()) if misfits else "")
        )
    else:
        best = fastest_simplest(ok + [ce for ce, _ in runnable], compressed)
    chosen_c = compressed.get(id(best))
    others = sorted(
        (
            e
            for e in ok + [ce for ce, _ in runnable]
            if e is not best and (e.step_s, e.bytes_per_step) != (best.step_s, best.bytes_per_step)
        ),
        key=lambda e: -e.samples_per_s,
    )  # (the same prediction under another name: torchrec's planner row)
    runner_up = others[0] if others else None
    if runner_up is not None and id(runner_up) in compressed:  # named as its row in the reason
        runner_up = dataclasses.replace(
            runner_up, strategy=f"{runner_up.strategy} --compress {compressed[id(runner_up)]}"
        )
    reason = (
        compressed_why(best, chosen_c, ok, runner_up) if chosen_c else plan_reason(best, profile, cluster, runner_up)
    )
    fastest = fastest_simplest(
        [
            e
            for e in estimates
            if e.feasible and e.strategy not in withheld and (e.strategy != CACHED or cache is not None)
        ]
    )
    if fastest is not best and fastest.samples_per_s > best.samples_per_s and fastest.strategy not in misfits:
        reason += f" ({fastest.strategy} is predicted faster, {fastest.samples_per_s:,.0f} samples/s; --strategy chose this one.)"
    left_out = [
        f"{k} {v}"
        + (f" (predicted faster, {e.samples_per_s:,.0f} samples/s)" if e.samples_per_s > best.samples_per_s else "")
        for e in estimates
        if (k := e.strategy) in misfits and (v := misfits[k]) and k != best.strategy
    ]
    if left_out:
        reason += " Does not fit the memory: " + "; ".join(left_out) + "."
    best_spec = strategy_spec(best.strategy)
    chosen = predict_memory(profile, cluster, best, schedule, forwards) if chosen_c else memory.get(best.strategy)
    cached = (
        plan_cache(
            *profiled(profile), cache, cluster.workers, {n for n, w in best.placement.items() if w == ON_SERVERS}
        )
        if best.strategy == CACHED
        else {}
    )
    return Plan(
        strategy=best_spec.runs_as or best.strategy,
        placement=dict(best.placement),
        partitions=dict(best.partitions),
        cache=cached,
        servers=cluster.servers if best_spec.servers else 0,
        stages=[list(s) for s in best.stages],
        micro_batches=best.micro_batches or 1,
        schedule=schedule,
        reason=reason,
        candidates=candidates,
        predicted_step_s=best.step_s,
        samples_per_s=best.samples_per_s,
        compute=compute_source(profile, cluster),
        replicas=best.replicas if best_spec.pipelined else 1,
        layout=best.layout if best_spec.pipelined else "",
        unused_params=list(profile.unused_params),
        memory=chosen.to_dict(cluster) if chosen is not None else {},
        compress=str(chosen_c or ""),
    )
