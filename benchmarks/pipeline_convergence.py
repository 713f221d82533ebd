"""Convergence of the asynchronous pipeline schedules against the synchronous one with the
training loop on: an LR schedule (linear warm-up, then cosine decay) and global-norm clipping.

Task: examples/cnn.py (scikit-learn's digits, real data; 1,500 training and 297 validation
images), through the real ``hpar run --strategy pipeline`` (K worker processes, gloo on CPU),
the example's SGD with momentum, batch 32, M micro-batches per batch. Each schedule runs
``--steps`` batches; the figure is the example's evaluate() accuracy of the final model
(summary.json ``eval_last``), for every seed and their mean.

The schedule spans the whole run in every schedule: the script's scheduler() is stepped once
per optimizer step of a stage, which is once per batch in 1f1b and once per micro-batch
update in async-stash/async-predict (docs/pipelines.md, the training loop in a pipeline), so
the wrapper script written for each run sets the schedule's length to steps x updates per batch.

Usage: python benchmarks/pipeline_convergence.py [--gpus 4] [--micro-batches 4] [--steps 200]
[--clip 1.0] [--seeds 0 1] [--schedules 1f1b async-stash async-predict] [--out FILE] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRAPPER = """
import math, sys
import torch
sys.path.insert(0, {examples!r})
from cnn import HPAR, model, data, loss, optimizer, evaluate   # noqa: F401  (the example, unchanged)

HPAR = dict(HPAR, steps={steps})
UPDATES_PER_STEP = {updates}


def scheduler(opt):   # 10 batches of linear warm-up, then cosine decay to 0 at the last batch
    total, warm = HPAR["steps"] * UPDATES_PER_STEP, 10 * UPDATES_PER_STEP
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
"""


def run(schedule: str, seed: int, args, work: str) -> dict:
    updates = 1 if schedule in ("1f1b", "gpipe", "async-2bw") else args.micro_batches
    script = os.path.join(work, f"cnn_{schedule}_{seed}.py")
    with open(script, "w") as f:
        f.write(WRAPPER.format(examples=os.path.join(ROOT, "examples"), steps=args.steps, updates=updates))
    run_dir = os.path.join(work, f"run_{schedule}_{seed}")
    t0 = time.time()
    with open(run_dir + ".out", "w") as out:
        code = subprocess.run(
            [
                sys.executable,
                "-m",
                "hpar.launcher.cli",
                "run",
                script,
                "--gpus",
                str(args.gpus),
                "--strategy",
                "pipeline",
                "--schedule",
                schedule,
                "--micro-batches",
                str(args.micro_batches),
                "--clip-grad-norm",
                str(args.clip),
                "--seed",
                str(seed),
                "--run-dir",
                run_dir,
                "--plain",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        ).returncode
    if code != 0:
        tail = open(run_dir + ".out").read().splitlines()[-15:]
        raise SystemExit(f"{schedule} seed {seed} failed with exit code {code}:\n" + "\n".join(tail))
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    return {
        "schedule": schedule,
        "seed": seed,
        "accuracy": summary["eval_last"]["accuracy"],
        "val_loss": summary["eval_last"]["loss"],
        "wall_s": round(time.time() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "async-stash", "async-predict"])
    ap.add_argument("--out")
    ap.add_argument(
        "--work", help="directory for the wrapper scripts and run directories (default: a new temporary one)"
    )
    args = ap.parse_args()
    rows = []
    work = args.work or tempfile.mkdtemp(prefix="hpar-conv-")  # kept: the runs' directories and output
    os.makedirs(work, exist_ok=True)
    for schedule in args.schedules:
        for seed in args.seeds:
            rows.append(run(schedule, seed, args, work))
            print(json.dumps(rows[-1]), flush=True)
    print(
        f"\nexamples/cnn.py, {args.gpus} stages, M={args.micro_batches}, {args.steps} steps, "
        f"warm-up + cosine LR, --clip-grad-norm {args.clip}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores\n"
    )
    print("| schedule | accuracy per seed | mean | val loss (mean) |\n|---|---|---|---|")
    base = None
    for schedule in args.schedules:
        mine = [r for r in rows if r["schedule"] == schedule]
        mean = statistics.mean(r["accuracy"] for r in mine)
        base = mean if base is None else base
        accs = ", ".join(f"{r['accuracy']:.4f}" for r in mine)
        print(
            f"| {schedule} | {accs} | {mean:.4f} "
            f"({100 * (mean - base):+.1f} points) | {statistics.mean(r['val_loss'] for r in mine):.4f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
