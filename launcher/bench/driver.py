"""``hpar bench``: run several strategies on the same job, one after another, and compare them.

Every strategy is trained by ``hpar run`` in a subprocess (the same launcher, process layout
and teardown as a user's run), with its own run directory ``BENCH_DIR/<script>/<strategy>``
and the same steps, batch size and seed. The measured figures come from that run's
``summary.json`` (worker 0's median step time after the 2 warm-up steps, as samples/s over
all workers; step time p50/p90) and ``metrics.jsonl`` (bytes per worker per step, the mean
over every worker's reports weighted by the steps each covers). The prediction next to it is
the cost model's (``strategies/plan/costmodel.py``) for the same cluster, from one profile per
script (``strategies/profile/profiler.profile_job``).

A strategy that does not apply says why instead of a number: the model is not a sequence of
layers (pipeline), or its run failed (the run's cause, or the launcher's last error line).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from hpar.launcher.bench.figures import bytes_per_worker_step, combine_runs, stage_figures

PLANNED = {"pipeline", "hybrid", "ps"}   # strategies whose runs take the planner's plan

# bench name -> (hpar run --strategy, --schedule or None)
BENCH_STRATEGIES: dict[str, tuple[str, str | None]] = {
    "hybrid": ("hybrid", None), "ps": ("ps", None), "allreduce": ("allreduce", None),
    "allreduce-sparse": ("allreduce-sparse", None),
    "pipeline-gpipe": ("pipeline", "gpipe"), "pipeline-1f1b": ("pipeline", "1f1b"),
    "pipeline-async-stash": ("pipeline", "async-stash"), "pipeline-async-predict": ("pipeline", "async-predict"),
    "pipeline-async-2bw": ("pipeline", "async-2bw"),
    "torch-gpipe": ("pipeline", "torch-gpipe"), "torch-1f1b": ("pipeline", "torch-1f1b"),
    "torch-interleaved-1f1b": ("pipeline", "torch-interleaved-1f1b"), "torch-zbv": ("pipeline", "torch-zbv"),
}


@dataclass(frozen=True)
class BenchConfig:
    """What to bench. ``hosts`` is a host spec for ``hpar run --hosts`` (None: this machine);
    ``bandwidth_Bps``/``latency_s`` None: probe the loopback link for the cost model;
    ``project`` > 0 adds the cost model's projection to that many GPUs; ``precision`` (None:
    the script's) is every run's ``--precision`` and the profile's; ``threads`` (None: ``hpar
    run``'s default) every process's CPU threads; ``repeat`` runs of every strategy, in rounds
    (every strategy once per round, so that a slow spell of the machine hits all of them)."""

    scripts: tuple[str, ...]
    gpus: int
    strategies: tuple[str, ...]
    steps: int
    bench_dir: str
    batch_size: int | None = None
    seed: int = 0
    hosts: str | None = None
    ssh_key: str | None = None
    bandwidth_Bps: float | None = None
    latency_s: float | None = None
    project: int = 0
    device_tflops: float | None = None
    timeout_s: float = 600.0
    precision: str | None = None
    threads: int | None = None     # every process's CPU threads (--env OMP_NUM_THREADS); None: hpar run's default
    repeat: int = 1     # runs of every strategy, interleaved (round r runs every strategy once)
    min_seconds: float = 0.0   # more steps for a strategy predicted faster: see steps_for


MAX_STEPS = 5000   # steps_for's ceiling


def steps_for(cfg: BenchConfig, predicted_step_s: float | None) -> int:
    """Steps of one strategy's run: ``cfg.steps``, or more so that the steps after the 2
    warm-up ones take ``cfg.min_seconds`` at the predicted step time (at most MAX_STEPS): a
    model that steps in milliseconds is otherwise measured over a fraction of a second, in
    which one slow step (a log line, a heartbeat) moves samples/s by tens of percent."""
    if not cfg.min_seconds or not predicted_step_s:
        return cfg.steps
    return max(cfg.steps, min(MAX_STEPS, 2 + math.ceil(cfg.min_seconds / predicted_step_s)))


@dataclass(frozen=True)
class Result:
    """One strategy on one script. Measured: ``samples_per_s`` (all workers), ``step_s_p50``/
    ``step_s_p90`` (seconds), ``bytes_per_step`` ({"sent", "recv"} bytes per worker per step).
    ``predicted_step_s`` is the cost model's; ``ratio`` = samples/s over the fastest strategy's
    of the same script (1.0 for the fastest); ``reason`` is None when it ran, else why not.
    ``projected`` holds the cost model's projection to ``BenchConfig.project`` GPUs."""

    script: str
    strategy: str
    samples_per_s: float | None = None
    step_s_p50: float | None = None
    step_s_p90: float | None = None
    bytes_per_step: dict | None = None
    predicted_step_s: float | None = None
    ratio: float | None = None
    reason: str | None = None
    run_dir: str | None = None
    wall_s: float | None = None
    projected: dict | None = None
    counters: dict | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_strategies(text: str | None) -> tuple[str, ...]:
    """``"hybrid,allreduce"`` -> names in BENCH_STRATEGIES (None or "all": every one).
    Raises ValueError naming ``--strategies`` and the valid names for an unknown one."""
    if not text or text.strip() == "all":
        return tuple(BENCH_STRATEGIES)
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [n for n in names if n not in BENCH_STRATEGIES]
    if bad or not names:
        raise ValueError(f"--strategies: unknown {', '.join(bad) or 'empty list'}; "
                         f"choose from {', '.join(BENCH_STRATEGIES)}")
    return names


def not_applicable(name: str, profile, estimates: dict, gpus: int) -> str | None:
    """Why strategy ``name`` cannot run this job (None when it can): model not a sequence of layers, too few workers or layers for a pipeline, fewer planned
    micro-batches than stages for torch's 1F1B."""
    strategy, schedule = BENCH_STRATEGIES[name]
    if strategy == "pipeline":
        if not profile.is_sequential:
            return f"not a sequence of layers: {profile.sequential_reason}"
        est = estimates.get("pipeline")
        if est is not None and not est.feasible:
            return est.note
        if schedule == "torch-1f1b" and est is not None and est.micro_batches < gpus:
            return (f"the plan's {est.micro_batches} micro-batch(es) per batch are fewer than the {gpus} stages "
                    "torch's Schedule1F1B needs (scripts/bench_pipeline.py compares it at M = 4)")
        if schedule.startswith("torch-") and est is not None:
            from hpar.strategies.pipeline.torch_peers import check_peer
            try:
                check_peer(schedule, len(profile.layers), gpus, est.micro_batches, profile.device)
            except ValueError as exc:
                return str(exc)
        if schedule == "async-2bw" and est is not None:
            from hpar.strategies.pipeline.schedules import check_2bw
            try:
                check_2bw(gpus, est.micro_batches)
            except ValueError as exc:
                return str(exc)
    return None


def run_command(script: str, name: str, cfg: BenchConfig, batch_size: int, run_dir: str,
                plan_file: str | None = None, steps: int | None = None) -> list[str]:
    """The ``hpar run`` command line of one strategy (no evaluation; plain progress lines);
    ``plan_file`` fixes the planned placement and partitions (hybrid, ps) or stages and
    micro-batches (pipeline entries: passed as ``--micro-batches`` too, so that a script's own
    HPAR value does not override the plan the prediction is for); ``steps`` (default
    ``cfg.steps``) the run's steps."""
    strategy, schedule = BENCH_STRATEGIES[name]
    steps = steps or cfg.steps
    cmd = [sys.executable, "-m", "hpar.launcher.cli", "run", script, "--gpus", str(cfg.gpus), "--strategy", strategy,
           "--steps", str(steps), "--batch-size", str(batch_size), "--seed", str(cfg.seed),
           "--log-every", str(max(1, min(10, steps // 4))), "--run-dir", run_dir, "--plain", "--no-eval"]
    if schedule:
        cmd += ["--schedule", schedule]
    if plan_file:
        cmd += ["--plan", plan_file]
        if strategy == "pipeline":
            with open(plan_file, encoding="utf-8") as f:
                cmd += ["--micro-batches", str(json.load(f)["micro_batches"])]
    if cfg.precision:
        cmd += ["--precision", cfg.precision]
    if cfg.hosts:
        cmd += ["--hosts", cfg.hosts]
    if cfg.ssh_key:
        cmd += ["--ssh-key", cfg.ssh_key]
    if cfg.threads:
        cmd += ["--env", f"OMP_NUM_THREADS={cfg.threads}"]
    return cmd


def _last_error(log_path: str) -> str:
    try:
        lines = [l.strip() for l in open(log_path, encoding="utf-8", errors="replace") if l.strip()]
    except OSError:
        return "no output"
    errs = [l for l in lines if l.startswith("hpar:")]
    return (errs or lines or ["no output"])[-1][:300]


def run_strategy(script: str, name: str, cfg: BenchConfig, batch_size: int, run_dir: str,
                 plan_file: str | None = None, steps: int | None = None) -> Result:
    """Train ``name`` on ``script`` with ``hpar run`` in a subprocess (its output goes to
    ``run_dir + ".log"``) and read the measured figures back. A run that fails or passes
    ``cfg.timeout_s`` gives a Result with ``reason``; its process group is stopped (SIGTERM,
    then SIGKILL after 15 s) so nothing is left behind."""
    log_path = run_dir + ".log"
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(run_command(script, name, cfg, batch_size, run_dir, plan_file, steps), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=cfg.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out, code = True, None
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.monotonic() - t0
    if timed_out:
        return Result(script, name, reason=f"timed out after {cfg.timeout_s:.0f} s", run_dir=run_dir, wall_s=wall)
    try:
        summary = json.load(open(os.path.join(run_dir, "summary.json"), encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        summary = {}
    if code != 0 or summary.get("exit_code", 1) != 0:
        cause = summary.get("cause")
        where = f"{summary.get('failed')} on {summary.get('failed_host')}: " if summary.get("failed") else ""
        return Result(script, name, reason=f"run failed ({where}{cause})" if cause else f"run failed: {_last_error(log_path)}",
                      run_dir=run_dir, wall_s=wall)
    sent_recv = bytes_per_worker_step(os.path.join(run_dir, "metrics.jsonl")) or summary.get("bytes_per_step")
    extra = {**{k: summary[k] for k in ("loss_first", "loss_last", "wall_s", "steps") if k in summary},
             **stage_figures(summary)}
    if summary.get("strategy") not in (None, name, BENCH_STRATEGIES[name][0]):
        extra["ran_as"] = summary["strategy"]   # e.g. a hybrid plan with nothing on the servers
    return Result(script, name, samples_per_s=summary.get("samples_per_s"), step_s_p50=summary.get("step_s_p50"),
                  step_s_p90=summary.get("step_s_p90"), bytes_per_step=sent_recv, run_dir=run_dir, wall_s=wall,
                  extra=extra)


def with_ratios(results: list[Result]) -> list[Result]:
    """Each result with ``ratio`` = its samples/s over the fastest of its script's results.
    A row that ran as another strategy (``extra["ran_as"]``) is measured against the others
    but never sets the fastest: it is not a contender in its own name (launcher/bench/verdict.py)."""
    best: dict[str, float] = {}
    for r in results:
        if r.samples_per_s and not (r.extra or {}).get("ran_as"):
            best[r.script] = max(best.get(r.script, 0.0), r.samples_per_s)
    return [dataclasses.replace(r, ratio=r.samples_per_s / best[r.script]) if r.samples_per_s and best.get(r.script)
            else r for r in results]


@dataclass(frozen=True)
class ScriptPlan:
    """One script's profile-based view: its batch size, the cost model's estimates for the
    bench's cluster (by cost-model strategy name), those for ``project`` GPUs, and why each
    bench strategy cannot run (name -> reason)."""

    batch_size: int
    estimates: dict
    projected: dict
    reasons: dict
    plan_files: dict = field(default_factory=dict)   # hpar run --strategy -> plan file


def plan_script(script: str, cfg: BenchConfig, names: tuple[str, ...], cluster_of, refine=None) -> ScriptPlan:
    """Profile ``script`` once (``profile_job`` for the bench's workers, or the projection's
    when larger, since the union of touched rows is measured per worker count) and estimate
    every strategy on ``cluster_of(gpus)`` (a ClusterSpec factory) with ``estimate_all``;
    ``refine(profile, cluster)``, when given, returns the bench's cluster with what was
    measured for this job (the emulated hosts' sparse exchange). Raises JobError/ValueError
    for a bad script or flags."""
    from hpar.strategies.plan.costmodel import estimate_all
    from hpar.strategies.job import check_job, load_job
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
    one_pipeline = 1 if any((BENCH_STRATEGIES[n][1] or "").startswith("torch-") for n in names) else None
    if one_pipeline:
        from hpar.strategies.plan.costmodel import estimate_pipeline
        estimates["pipeline"] = estimate_pipeline(profile, cluster, replicas=1)
    reasons = {n: why for n in names if (why := not_applicable(n, profile, estimates, cfg.gpus))}
    # the planner's plan of each planned strategy, so that its runs execute what was
    # predicted (pipeline: stages and micro-batches, one plan for hpar's and torch's schedules
    # alike; hybrid/ps: placement and partitions) rather than each run re-profiling
    from hpar.strategies.checkpoint import atomic_write_bytes
    from hpar.strategies.plan.planner import choose_plan
    stem = os.path.splitext(os.path.basename(script))[0]
    # what the predictions were made from, so that a later cost model can be checked on these runs
    atomic_write_bytes(os.path.join(os.path.abspath(cfg.bench_dir), f"{stem}-profile.json"),
                       json.dumps({"profile": profile.to_dict(), "cluster": dataclasses.asdict(cluster)}).encode())
    plan_files = {}
    for strategy in sorted({BENCH_STRATEGIES[n][0] for n in names if n not in reasons} & PLANNED):
        path = os.path.join(os.path.abspath(cfg.bench_dir), f"{stem}-{strategy}-plan.json")
        atomic_write_bytes(path, choose_plan(profile, cluster, force=strategy, pipeline_replicas=one_pipeline
                                             if strategy == "pipeline" else None).to_json().encode())
        plan_files[strategy] = path
    return ScriptPlan(bs, estimates, projected, reasons, plan_files)


def _prediction(estimates: dict, name: str) -> float | None:
    from hpar.strategies.plan.costmodel import estimate_async_pipeline
    strategy, schedule = BENCH_STRATEGIES[name]
    est = estimates.get(strategy)
    if est is not None and strategy == "pipeline" and schedule:
        est = estimate_async_pipeline(est, schedule)
    return est.step_s if est is not None and est.feasible and est.step_s > 0 else None


def _projection(plan: ScriptPlan, name: str, gpus: int) -> dict | None:
    if not plan.projected:
        return None
    est = plan.projected.get(BENCH_STRATEGIES[name][0])
    if est is None or not est.feasible:
        return {"gpus": gpus, "projected": True, "step_s": None, "samples_per_s": None,
                "note": est.note if est is not None else "no estimate"}
    return {"gpus": gpus, "projected": True, "step_s": est.step_s, "samples_per_s": est.samples_per_s,
            "bytes_per_step": est.bytes_per_step, "note": est.note}


def run_bench(cfg: BenchConfig, cluster_of, say=print, around_run=None, refine=None) -> list[Result]:
    """Bench every script and strategy of ``cfg`` in order; returns the Results with ratios.
    ``cluster_of(gpus)`` builds the cost model's ClusterSpec (``refine``: :func:`plan_script`'s);
    ``say`` prints progress lines;
    ``around_run(run)`` (optional, e.g. the emulated cluster's counter sampler) wraps each
    strategy's run: it calls ``run()`` and returns (Result, counters dict or None)."""
    os.makedirs(cfg.bench_dir, exist_ok=True)
    results: list[Result] = []
    for script in cfg.scripts:
        stem = os.path.splitext(os.path.basename(script))[0]
        say(f"hpar bench: profiling {script}")
        plan = plan_script(script, cfg, cfg.strategies, cluster_of, refine)
        runs: dict[str, list[Result]] = {}
        for round_ in range(cfg.repeat):
            for name in cfg.strategies:
                if name in plan.reasons:
                    continue
                suffix = f"-run{round_ + 1}" if cfg.repeat > 1 else ""
                run_dir = os.path.join(cfg.bench_dir, stem, name + suffix)
                os.makedirs(os.path.dirname(run_dir), exist_ok=True)
                steps = steps_for(cfg, _prediction(plan.estimates, name))
                say(f"hpar bench: {stem} {name}{suffix}: running ({cfg.gpus} workers, {steps} steps, "
                    f"batch {plan.batch_size})")
                plan_file = plan.plan_files.get(BENCH_STRATEGIES[name][0])
                run = lambda: run_strategy(os.path.abspath(script), name, cfg, plan.batch_size, run_dir, plan_file,
                                           steps)
                counters = None
                if around_run is None:
                    res = run()
                else:
                    res, counters = around_run(run)
                res = dataclasses.replace(res, counters=counters)
                say(f"hpar bench: {stem} {name}{suffix}: " + (res.reason or f"{res.samples_per_s:,.1f} samples/s"))
                runs.setdefault(name, []).append(res)
        for name in cfg.strategies:
            pred = _prediction(plan.estimates, name)
            proj = _projection(plan, name, cfg.project)
            if name in plan.reasons:
                say(f"hpar bench: {stem} {name}: skipped ({plan.reasons[name]})")
                results.append(Result(script, name, predicted_step_s=pred, reason=plan.reasons[name], projected=proj))
                continue
            res = combine_runs(runs[name])
            results.append(dataclasses.replace(res, script=script, predicted_step_s=pred, projected=proj,
                                               extra={**res.extra, "batch_size": plan.batch_size}))
    return with_ratios(results)
