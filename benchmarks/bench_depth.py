"""Depth table of hpar's pipeline schedules: accuracy and samples/s at K = 2, 4, 8 stages.

Task: examples/deep_mlp.py (9-layer ReLU MLP, 32 -> 128 x 7 -> 10, on a random two-layer tanh
teacher; batch 64). Accuracy: the single-process simulator (strategies/runtimes/pipeline/sim.py,
which tests/test_pipeline.py checks to give the multi-process runtime's bits) trains
``--steps`` batches, then the example's evaluate() on 2,048 held-out samples; mean over
``--seeds`` model seeds. Schedules run with M = 1 micro-batch per batch (one update per
batch of 64 in every schedule), except async-2bw, which needs M >= K-1 and runs with
M = K (still one update per batch of 64, gradients one version old). Optimizer: SGD with
momentum 0.9, dampening 0.9 (``--opt sgd``) or AdamW, weight decay 0.01 (``--opt adamw``).

samples/s (``--speed-steps`` > 0): K real worker processes (gloo on CPU, one thread each)
for that many steps of the same configuration, rank 0's summary (samples_per_s).

Usage: python benchmarks/bench_depth.py [--opt sgd|adamw] [--lr 0.6] [--steps 875] [--seeds 1]
[--depths 2 4 8] [--speed-steps 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEP = os.path.join(ROOT, "examples", "deep_mlp.py")
SCHEDULES = ("1f1b", "async-stash", "async-predict", "async", "async-2bw")


def micro_for(schedule: str, stages: int) -> int:
    return stages if schedule == "async-2bw" else 1


def accuracy(schedule: str, stages: int, steps: int, lr: float, seed: int) -> float:
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.runtimes.pipeline.sim import simulate

    job = load_job(DEEP)
    r = simulate(
        job, schedule, stages, steps=steps, batch_size=64, micro_batches=micro_for(schedule, stages), lr=lr, seed=seed
    )
    return job.run_evaluate(r.model)["accuracy"]


def samples_per_s(schedule: str, stages: int, steps: int, lr: float) -> float:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_pipeline import run_workers

    s = run_workers(DEEP, "pipeline", stages, steps, 64, schedule, micro_for(schedule, stages), lr=lr)
    return s["samples_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--opt", choices=("sgd", "adamw"), default="sgd")
    ap.add_argument("--lr", type=float, default=0.6)
    ap.add_argument("--steps", type=int, default=875)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--speed-steps", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_depth.md"))
    args = ap.parse_args()
    os.environ["HPAR_DEEP_MLP_OPT"] = args.opt
    torch.set_num_threads(1)
    lines = [
        f"Command: `python benchmarks/bench_depth.py {' '.join(sys.argv[1:])}`  ",
        f"Machine: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, shared with other jobs; "
        f"date {datetime.datetime.now().isoformat(timespec='minutes')}; torch {torch.__version__}",
        "",
        "| K | schedule | M | val accuracy (mean"
        + (f" of {args.seeds} seeds, min-max)" if args.seeds > 1 else ")")
        + (" | samples/s |" if args.speed_steps else " |"),
        "|---|---|---|---|" + ("---|" if args.speed_steps else ""),
    ]
    for k in args.depths:
        for schedule in args.schedules:
            accs = [accuracy(schedule, k, args.steps, args.lr, seed) for seed in range(args.seeds)]
            cell = f"{100 * statistics.mean(accs):.1f}%"
            if args.seeds > 1:
                cell += f" ({100 * min(accs):.1f}-{100 * max(accs):.1f})"
            row = f"| {k} | {schedule} | {micro_for(schedule, k)} | {cell} |"
            if args.speed_steps:
                row += f" {samples_per_s(schedule, k, args.speed_steps, args.lr):.0f} |"
            print(row, flush=True)
            lines.append(row)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
