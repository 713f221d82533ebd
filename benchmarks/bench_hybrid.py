"""Benchmark hybrid data parallelism against its peers, in one run, as ratios.

For each example (examples/lm.py, examples/recsys.py) it trains with ``hpar run`` and the
same workers, steps and batch under ``hybrid``, ``allreduce`` (dense gradients, DDP) and
``allreduce-sparse`` (DDP with sparse embedding gradients: AllGather on gloo), reads each
run's summary.json, and reports samples/s and bytes per worker per step (sent + received),
the ratios against hybrid, and hybrid's bytes against the minimum: the rows a worker's
batch touches pulled and their gradients pushed (ids and values each way) plus the ring
AllReduce of the dense parameters, 2(N-1)/N of their bytes each way. Touched rows are
counted by running the model's forward on a few of each worker's batches with hooks on
its embedding modules.

Usage: ``python benchmarks/bench_hybrid.py [--workers 2] [--steps 30] [--repeats 2] [--out /tmp/bench_hybrid.md]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

from hpar.strategies.runtimes.dataparallel.allreduce import ring_allreduce_bytes
from hpar.strategies.job.contract import load_job
from hpar.strategies.plan.placement import embedding_weights

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGIES = ("hybrid", "allreduce", "allreduce-sparse")


def run(script: str, strategy: str, workers: int, steps: int, run_dir: str, extra: list[str]) -> dict:
    """``hpar run`` one configuration; returns its summary.json. Raises on failure."""
    cmd = [
        "hpar",
        "run",
        script,
        "--gpus",
        str(workers),
        "--strategy",
        strategy,
        "--steps",
        str(steps),
        "--run-dir",
        run_dir,
        "--plain",
        "--no-eval",
        "--log-every",
        str(max(1, steps // 3)),
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def minimum_bytes(script: str, workers: int, batch_size: int, batches: int = 5, seed: int = 0) -> float:
    """Minimum bytes per worker per step (sent + received) of synchronous training with the
    embedding tables on servers and the rest on ring AllReduce: each touched row's id and
    value pulled, its id and gradient pushed, plus 2 x 2(N-1)/N of the dense bytes."""
    job = load_job(script)
    torch.manual_seed(seed)
    model = job.build_model()
    emb = embedding_weights(model)
    counts: list[float] = []
    hooks = []
    for name, module in model.named_modules():
        if f"{name}.weight" in emb:
            dim = module.weight.shape[1] * module.weight.element_size()
            hooks.append(
                module.register_forward_pre_hook(
                    lambda m, args, dim=dim: counts.append(torch.unique(args[0]).numel() * (2 * dim + 2 * 8))
                )
            )
    total = 0.0
    with torch.no_grad():
        for rank in range(workers):
            it = job.batches(rank, workers, batch_size)
            for _ in range(batches):
                inputs, _ = next(it)
                model(inputs)
    for h in hooks:
        h.remove()
    total = sum(counts) / (workers * batches)
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in emb)
    return total + 2 * ring_allreduce_bytes(dense, workers)


def bench(script: str, workers: int, steps: int, batch_size: int | None, root: str, repeats: int) -> dict:
    """Run every strategy ``repeats`` times, interleaved (so a burst of load on a shared
    machine hits all of them alike), and keep each strategy's best samples/s (as timeit
    does); bytes per step are deterministic."""
    extra = ["--batch-size", str(batch_size)] if batch_size else []
    rows = {}
    for rep in range(repeats):
        for strategy in STRATEGIES:
            run_dir = os.path.join(root, f"{os.path.basename(script)}-{strategy}-{rep}")
            s = run(script, strategy, workers, steps, run_dir, extra)
            b = s["bytes_per_step"]
            row = rows.setdefault(strategy, {"samples_per_s": 0.0, "runs": []})
            row["runs"].append(s["samples_per_s"])
            row.update(
                samples_per_s=max(row["runs"]),
                bytes=b["sent"] + b["recv"],
                sent=b["sent"],
                recv=b["recv"],
                loss_last=s["loss_last"],
            )
    bs = batch_size or load_job(script).defaults.get("batch_size", 32)
    minimum = minimum_bytes(script, workers, bs)
    h = rows["hybrid"]
    return {
        "rows": rows,
        "minimum_bytes": minimum,
        "batch_size": bs,
        "speedup_vs_allreduce": h["samples_per_s"] / rows["allreduce"]["samples_per_s"],
        "speedup_vs_allreduce_sparse": h["samples_per_s"] / rows["allreduce-sparse"]["samples_per_s"],
        "bytes_fraction_of_allreduce": h["bytes"] / rows["allreduce"]["bytes"],
        "bytes_over_minimum": h["bytes"] / minimum,
    }


def markdown(results: dict, args, cmdline: str) -> str:
    lines = [
        "## Hybrid data parallelism (Parallax) vs AllReduce peers",
        "",
        f"Command: `{cmdline}`  ",
        f"Machine: {platform.node()}, {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, "
        f"CPU workers on gloo, 1 server; torch {torch.__version__}; date {datetime.date.today()}  ",
        f"{args.workers} workers, {args.steps} steps per run, best of {args.repeats} interleaved runs; samples/s from "
        "the median step after warm-up (all runs in brackets); bytes "
        "are per worker per step, sent + received.",
        "",
    ]
    for script, r in results.items():
        lines += [
            f"### {script} (batch {r['batch_size']} per worker)",
            "",
            "| strategy | samples/s | bytes/step/worker | last loss |",
            "|---|---:|---:|---:|",
        ]
        for name, row in r["rows"].items():
            runs = ", ".join(f"{x:.0f}" for x in row["runs"])
            lines.append(
                f"| {name} | {row['samples_per_s']:.1f} ({runs}) | {row['bytes']:,.0f} | {row['loss_last']:.4f} |"
            )
        lines += [
            "",
            f"- hybrid samples/s: {r['speedup_vs_allreduce']:.2f}x allreduce (target >= 3), "
            f"{r['speedup_vs_allreduce_sparse']:.2f}x allreduce-sparse (target >= 1)",
            f"- hybrid bytes: {r['bytes_fraction_of_allreduce']:.4f} of allreduce (target <= 0.05), "
            f"{r['bytes_over_minimum']:.2f}x the minimum {r['minimum_bytes']:,.0f} (target <= 1.5)",
            "",
        ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=None, help="per worker (default: each script's HPAR)")
    ap.add_argument(
        "--scripts",
        nargs="+",
        default=[os.path.join(HERE, "examples", "lm.py"), os.path.join(HERE, "examples", "recsys.py")],
    )
    ap.add_argument("--repeats", type=int, default=2, help="runs per strategy; the best samples/s is kept")
    ap.add_argument("--out", default="/tmp/bench_hybrid.md")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="hpar-bench-") as root:
        for script in args.scripts:
            results[os.path.relpath(script, HERE)] = bench(
                script, args.workers, args.steps, args.batch_size, root, args.repeats
            )
            print(json.dumps(results, indent=1), flush=True)
    text = markdown(results, args, "python " + " ".join([os.path.relpath(sys.argv[0], HERE)] + sys.argv[1:]))
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
