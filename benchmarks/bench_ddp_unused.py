"""What DDP's ``find_unused_parameters=True`` costs hpar's allreduce and hybrid strategies.

hpar wraps the dense part of every model in DDP with ``find_unused_parameters=True``, so a
model that skips a branch in some steps (tests/zoo) trains instead of failing on its second
step. The price is a walk of the autograd graph after every forward. This script measures it
on the project's examples: 2 processes (gloo, one thread each), the example's model, data,
loss and optimizer, the same steps with the flag on and off, interleaved ``--repeats`` times.
It reports the median step time of each setting, the ratio on/off and the run-to-run spread
(max/min of the repeats' medians per setting): a cost is shown only beyond that spread.

Usage: python benchmarks/bench_ddp_unused.py [--steps 30] [--repeats 3] [examples/wide.py ...]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from hpar.strategies.job.contract import load_job
from hpar.strategies.plan.cluster import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 3


def _steps(rank: int, script: str, steps: int, batch_size: int, find_unused: bool) -> float:
    """Median seconds per training step of one process of a 2-process DDP run."""
    job = load_job(script)
    torch.manual_seed(0)
    model = DDP(job.build_model(), find_unused_parameters=find_unused)
    opt = job.build_optimizer(model.parameters(), 0.01)
    batches = job.batches(rank, 2, batch_size)
    times = []
    for _ in range(steps + WARMUP):
        inputs, targets = next(batches)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        job.compute_loss(model(inputs), targets).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:])


def _worker(rank: int, port: int, jobs: list, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for key, (script, steps, batch_size, find_unused) in enumerate(jobs):
        t = _steps(rank, script, steps, batch_size, find_unused)
        if rank == 0:
            out[key] = t
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "scripts", nargs="*", default=[os.path.join(ROOT, "examples", s) for s in ("wide.py", "lm.py", "cnn.py")]
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    jobs = [
        (s, args.steps, args.batch_size, flag)
        for _ in range(args.repeats)
        for s in args.scripts
        for flag in (True, False)
    ]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), jobs, out), nprocs=2)
    print(f"command: python benchmarks/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}".rstrip())
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print("| script | step on (ms) | step off (ms) | on/off | spread (max/min of repeats) |")
    print("|---|---|---|---|---|")
    for s in args.scripts:
        on = [out[k] for k, j in enumerate(jobs) if j[0] == s and j[3]]
        off = [out[k] for k, j in enumerate(jobs) if j[0] == s and not j[3]]
        spread = max(max(on) / min(on), max(off) / min(off))
        ratio = statistics.median(on) / statistics.median(off)
        print(
            f"| {os.path.basename(s)} | {1e3 * statistics.median(on):.2f} | {1e3 * statistics.median(off):.2f} | "
            f"{ratio:.3f} | {spread:.3f} |"
        )


if __name__ == "__main__":
    main()
