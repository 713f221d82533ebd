"""What a bench entry's run directory says beyond summary.json's headline figures: bytes per
worker per step from metrics.jsonl, and a pipeline's bubble and peak memory per stage; and
one entry's figures from its repeated runs (``hpar bench --repeat``)."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

from hpar.strategies.specs.decision import Plan


def bytes_per_worker_step(metrics_path: str) -> dict | None:
    """{"sent", "recv"}: mean bytes per worker per step from ``metrics.jsonl``, each worker's
    interval means weighted by the steps of the interval, then averaged over workers.
    None when the file holds no worker metric."""
    per_rank: dict[int, list[tuple[int, float, float]]] = {}
    try:
        with open(metrics_path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("kind") == "metric" and rec.get("role") == "worker" and "bytes_sent" in rec:
                    per_rank.setdefault(rec["rank"], []).append(
                        (rec["step"], rec["bytes_sent"], rec.get("bytes_recv", 0.0))
                    )
    except OSError:
        return None
    means = []
    for recs in per_rank.values():
        recs.sort()
        prev, total, sent, recv = 0, 0, 0.0, 0.0
        for step, s, r in recs:
            k = max(step - prev, 0)
            prev = step
            total, sent, recv = total + k, sent + s * k, recv + r * k
        if total:
            means.append((sent / total, recv / total))
    if not means:
        return None
    return {"sent": statistics.fmean(m[0] for m in means), "recv": statistics.fmean(m[1] for m in means)}


def stage_figures(summary: dict) -> dict:
    """A pipeline run's bubble and memory from its summary's per-stage figures: ``bubble`` =
    idle over (compute + idle) summed over the stages (the fraction of stage time spent
    waiting), ``peak_mem_bytes`` = the largest stage's peak (strategies/common/measured_memory.py).
    Empty for other strategies; a figure a runtime did not measure is left out."""
    stages = summary.get("stages") or []
    out = {}
    idle = [s.get("idle_s") for s in stages]
    compute = [s.get("compute_s") for s in stages]
    if stages and all(isinstance(v, (int, float)) for v in idle + compute) and sum(idle) + sum(compute) > 0:
        out["bubble"] = sum(idle) / (sum(idle) + sum(compute))
    peaks = [s.get("peak_mem_bytes") for s in stages]
    if stages and all(isinstance(v, int) for v in peaks):
        out["peak_mem_bytes"] = max(peaks)
    return out


def memory_figures(summary: dict, run_dir: str) -> dict:
    """A run's measured and predicted peak memory (summary.json's ``peak_bytes`` and
    ``predicted_peak_bytes``, per worker and per server) and the predicted terms of its
    busiest worker and server (plan.json's ``memory``, strategies/plan/memory_model.py); empty for a
    run that reported none."""
    out = {}
    if summary.get("peak_bytes"):
        out["peak_bytes"] = summary["peak_bytes"]
        out["predicted_peak_bytes"] = summary.get("predicted_peak_bytes") or {}
    try:
        with open(os.path.join(run_dir, "plan.json"), encoding="utf-8") as f:
            memory = Plan.from_dict(json.load(f)).memory or {}
    except (OSError, ValueError):
        memory = {}
    if memory:
        out["memory_terms"] = {"worker": memory.get("worker_terms") or {}, "server": memory.get("server_terms") or {}}
    return out


def combine_runs(runs: list):
    """One bench Result (launcher/bench/driver.py) from the repeated runs of one strategy: the run with the median samples/s
    (for an even count the slower of the middle two), its bytes, step times and run
    directory, with every run's samples/s in ``extra["runs_samples_per_s"]`` (run order)
    when there are several. A failed run makes the whole a failure: its reason, naming
    which run failed."""
    assert runs, "at least one run"
    for i, r in enumerate(runs):
        if r.reason:
            where = f"run {i + 1} of {len(runs)}: " if len(runs) > 1 else ""
            return dataclasses.replace(r, reason=where + r.reason)
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda r: r.samples_per_s)
    median = ordered[(len(ordered) - 1) // 2]
    return dataclasses.replace(median, extra={**median.extra, "runs_samples_per_s": [r.samples_per_s for r in runs]})
