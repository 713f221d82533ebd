"""Where the CPU of an ``hpar bench`` run went: per run, the workers' and the servers' CPU.

Every worker and server of a run sends a heartbeat every ~2 s with its process's CPU percent
since the previous one (psutil: all its threads, user and system time; workers/report.py),
kept in the run directory's ``metrics.jsonl``. This script takes the heartbeats sent while the
workers were training (from the first heartbeat at step 2 or later to the last one before the
final 2 steps), averages each process's CPU percent, and sums them by role. With the step time
(samples per step over the run's samples/s) that gives the CPU seconds a step costs the
workers together and the servers together, and how much of the machine's cores the run used.

Usage: ``python benchmarks/bench_cpu.py BENCH_DIR [--cores N]`` (default: this machine's cores),
where BENCH_DIR is an ``hpar bench --scale`` directory (``hosts-N/<script>/<strategy>/``) or a
single run directory. Prints one markdown row per run with heartbeats in its training window.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys


def run_cpu(run_dir: str) -> dict | None:
    """``{"workers_pct", "servers_pct", "step_s", "worker_cpu_s", "server_cpu_s", "processes"}``
    of one run directory: the summed mean CPU percent of its workers and of its servers over
    the training window (100 = one core), the mean step (seconds), and the CPU seconds per step
    of all workers together and of all servers together; None when the run left no summary or
    fewer than two worker heartbeats in its window."""
    try:
        summary = json.load(open(os.path.join(run_dir, "summary.json"), encoding="utf-8"))
        config = json.load(open(os.path.join(run_dir, "config.json"), encoding="utf-8"))
        lines = open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8").read().splitlines()
    except (OSError, ValueError):
        return None
    steps, rate = summary.get("steps") or 0, summary.get("samples_per_s") or 0
    beats = [
        b
        for b in (json.loads(line) for line in lines if line.strip())
        if b.get("kind") == "heartbeat" and "cpu_percent" in b
    ]
    window = [b["time"] for b in beats if b.get("role") == "worker" and 2 <= b.get("at_step", 0) <= steps - 2]
    if len(window) < 2 or not rate:
        return None
    t0, t1 = min(window), max(window)
    per: dict[tuple, list[float]] = {}
    for b in beats:
        if t0 <= b["time"] <= t1:
            per.setdefault((b["role"], b["rank"]), []).append(b["cpu_percent"])
    pct = {role: sum(statistics.mean(v) for (r, _), v in per.items() if r == role) for role in ("worker", "server")}
    step_s = config["batch_size"] * config["world_size"] / rate
    return {
        "workers_pct": pct["worker"],
        "servers_pct": pct["server"],
        "step_s": step_s,
        "worker_cpu_s": pct["worker"] / 100 * step_s,
        "server_cpu_s": pct["server"] / 100 * step_s,
        "processes": len(per),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_dir")
    ap.add_argument("--cores", type=float, default=float(os.cpu_count() or 1))
    args = ap.parse_args(argv)
    runs = sorted(glob.glob(os.path.join(args.bench_dir, "hosts-*", "*", "*", ""))) or [args.bench_dir]
    print(
        "| run | step (ms) | workers' CPU (% of a core) | servers' CPU | CPU ms per step, workers + servers | "
        "share of the cores |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for run in runs:
        got = run_cpu(run)
        if got is None:
            continue
        name = "/".join(os.path.normpath(run).split(os.sep)[-3:])
        total = got["workers_pct"] + got["servers_pct"]
        print(
            f"| {name} | {1e3 * got['step_s']:,.1f} | {got['workers_pct']:.0f} | {got['servers_pct']:.0f} | "
            f"{1e3 * got['worker_cpu_s']:,.1f} + {1e3 * got['server_cpu_s']:,.1f} | {total / args.cores:.0f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
