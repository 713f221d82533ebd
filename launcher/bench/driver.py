"""``hpar bench``: run several strategies on the same job, one after another, and compare them.

Every strategy is trained by ``hpar run`` in a subprocess (the same launcher, process layout
and teardown as a user's run), with its own run directory ``BENCH_DIR/<script>/<strategy>``
and the same steps, batch size and seed. The measured figures come from that run's
``summary.json`` (worker 0's median step time after the 2 warm-up steps, as samples/s over
all workers; step time p50/p90) and ``metrics.jsonl`` (bytes per worker per step, the mean
over every worker's reports weighted by the steps each covers). The prediction next to it is
the cost model's (``strategies/plan/costmodel.py``) for the same cluster, from one profile per
script (``strategies/profile/profiler.profile_job``; launcher/bench/bench_plans.py). What to run,
and for how many steps: launcher/bench/bench_config.py.

A strategy that does not apply says why instead of a number: the model is not a sequence of
layers (pipeline), or its run failed (the run's cause, or the launcher's last error line).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from hpar.strategies.specs.decision import Plan
from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.launcher.bench.bench_config import BenchConfig, bench_entry, row_compress, row_dir, steps_for
from hpar.launcher.bench.plots import bytes_per_worker_step, combine_runs, memory_figures, stage_figures
from hpar.launcher.bench.bench_plans import plan_script, prediction, projection


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


def run_command(
    script: str,
    name: str,
    cfg: BenchConfig,
    batch_size: int,
    run_dir: str,
    plan_file: str | None = None,
    steps: int | None = None,
) -> list[str]:
    """The ``hpar run`` command line of one strategy (no evaluation; plain progress lines);
    ``plan_file`` fixes the planned placement and partitions (hybrid, ps) or stages and
    micro-batches (pipeline entries: passed as ``--micro-batches`` too, so that a script's own
    HPAR value does not override the plan the prediction is for); ``steps`` (default
    ``cfg.steps``) the run's steps."""
    strategy, schedule = bench_entry(name)
    steps = steps or cfg.steps
    cmd = [
        sys.executable,
        "-m",
        "hpar.launcher.cli",
        "run",
        script,
        "--gpus",
        str(cfg.gpus),
        "--strategy",
        strategy,
        "--steps",
        str(steps),
        "--batch-size",
        str(batch_size),
        "--seed",
        str(cfg.seed),
        "--log-every",
        str(max(1, min(10, steps // 4))),
        "--run-dir",
        run_dir,
        "--plain",
        "--no-eval",
    ]
    if schedule:
        cmd += ["--schedule", schedule]
    if row_compress(name):
        cmd += ["--compress", row_compress(name)]
    if plan_file:
        cmd += ["--plan", plan_file]
        if strategy_spec(strategy).pipelined:
            with open(plan_file, encoding="utf-8") as f:
                cmd += ["--micro-batches", str(Plan.from_dict(json.load(f)).micro_batches)]
    if cfg.precision:
        cmd += ["--precision", cfg.precision]
    if cfg.hosts:
        cmd += ["--hosts", cfg.hosts]
    if cfg.ssh_key:
        cmd += ["--ssh-key", cfg.ssh_key]
    if cfg.threads:
        cmd += ["--env", f"OMP_NUM_THREADS={cfg.threads}"]
    for flag, gb in (("--worker-memory", cfg.worker_memory_gb), ("--server-memory", cfg.server_memory_gb)):
        if gb is not None:
            cmd += [flag, f"{gb:g}"]
    return cmd


def _last_error(log_path: str) -> str:
    try:
        lines = [l.strip() for l in open(log_path, encoding="utf-8", errors="replace") if l.strip()]
    except OSError:
        return "no output"
    errs = [l for l in lines if l.startswith("hpar:")]
    return (errs or lines or ["no output"])[-1][:300]


def drop_models(run_dir: str) -> list[str]:
    """Remove a finished bench run's trained model (``model/``, ``hf/``) and checkpoints: the
    bench keeps its figures, logs and metrics, not tens of MB of weights per run. Only in a
    marked run directory (strategies/state/trust.py); returns what was removed."""
    import shutil
    from hpar.strategies.state.trust import is_marked

    if not is_marked(run_dir):
        return []
    gone = [os.path.join(run_dir, n) for n in ("model", "hf", "checkpoints") if os.path.isdir(os.path.join(run_dir, n))]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def run_strategy(
    script: str,
    name: str,
    cfg: BenchConfig,
    batch_size: int,
    run_dir: str,
    plan_file: str | None = None,
    steps: int | None = None,
) -> Result:
    """Train ``name`` on ``script`` with ``hpar run`` in a subprocess (its output goes to
    ``run_dir + ".log"``) and read the measured figures back. A run that fails or passes
    ``cfg.timeout_s`` gives a Result with ``reason``; its process group is stopped (SIGTERM,
    then SIGKILL after 15 s) so nothing is left behind."""
    log_path = run_dir + ".log"
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            run_command(script, name, cfg, batch_size, run_dir, plan_file, steps),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
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
    if not cfg.keep_models:
        drop_models(run_dir)
    if code != 0 or summary.get("exit_code", 1) != 0:
        cause = summary.get("cause")
        where = f"{summary.get('failed')} on {summary.get('failed_host')}: " if summary.get("failed") else ""
        return Result(
            script,
            name,
            reason=f"run failed ({where}{cause})" if cause else f"run failed: {_last_error(log_path)}",
            run_dir=run_dir,
            wall_s=wall,
        )
    sent_recv = bytes_per_worker_step(os.path.join(run_dir, "metrics.jsonl")) or summary.get("bytes_per_step")
    extra = {
        **{k: summary[k] for k in ("loss_first", "loss_last", "wall_s", "steps") if k in summary},
        **stage_figures(summary),
        **memory_figures(summary, run_dir),
    }
    if summary.get("strategy") not in (None, name, bench_entry(name)[0]):
        extra["ran_as"] = summary["strategy"]  # e.g. a hybrid plan with nothing on the servers
    return Result(
        script,
        name,
        samples_per_s=summary.get("samples_per_s"),
        step_s_p50=summary.get("step_s_p50"),
        step_s_p90=summary.get("step_s_p90"),
        bytes_per_step=sent_recv,
        run_dir=run_dir,
        wall_s=wall,
        extra=extra,
    )


def with_ratios(results: list[Result]) -> list[Result]:
    """Each result with ``ratio`` = its samples/s over the fastest of its script's results.
    A row that ran as another strategy (``extra["ran_as"]``) is measured against the others
    but never sets the fastest: it is not a contender in its own name (launcher/bench/verdict.py)."""
    best: dict[str, float] = {}
    for r in results:
        if r.samples_per_s and not (r.extra or {}).get("ran_as"):
            best[r.script] = max(best.get(r.script, 0.0), r.samples_per_s)
    return [
        dataclasses.replace(r, ratio=r.samples_per_s / best[r.script]) if r.samples_per_s and best.get(r.script) else r
        for r in results
    ]


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
                run_dir = os.path.join(cfg.bench_dir, stem, row_dir(name) + suffix)
                os.makedirs(os.path.dirname(run_dir), exist_ok=True)
                steps = steps_for(cfg, prediction(plan.estimates, name))
                say(
                    f"hpar bench: {stem} {name}{suffix}: running ({cfg.gpus} workers, {steps} steps, "
                    f"batch {plan.batch_size})"
                )
                plan_file = plan.plan_files.get(bench_entry(name)[0])
                run = lambda: run_strategy(
                    os.path.abspath(script), name, cfg, plan.batch_size, run_dir, plan_file, steps
                )
                counters = None
                if around_run is None:
                    res = run()
                else:
                    res, counters = around_run(run)
                res = dataclasses.replace(res, counters=counters)
                say(f"hpar bench: {stem} {name}{suffix}: " + (res.reason or f"{res.samples_per_s:,.1f} samples/s"))
                runs.setdefault(name, []).append(res)
        for name in cfg.strategies:
            pred = prediction(plan.estimates, name)
            proj = projection(plan, name, cfg.project)
            if name in plan.reasons:
                say(f"hpar bench: {stem} {name}: skipped ({plan.reasons[name]})")
                results.append(Result(script, name, predicted_step_s=pred, reason=plan.reasons[name], projected=proj))
                continue
            res = combine_runs(runs[name])
            results.append(
                dataclasses.replace(
                    res,
                    script=script,
                    predicted_step_s=pred,
                    projected=proj,
                    extra={**res.extra, "batch_size": plan.batch_size},
                )
            )
    from hpar.launcher.bench.verdict import with_uncompressed

    return with_uncompressed(with_ratios(results))
