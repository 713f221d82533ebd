"""How many cores' worth of compute this machine gives processes that compute at once: the
cost model's cores per host for workers on this machine's CPU (``ClusterSpec.cores_per_host``,
read by ``costmodel.cpu_share`` and ``cpu_load``).

Why not ``os.cpu_count()``: a virtual machine's vCPUs may share physical cores (hyperthreads
of one core, or a host that gives the VM less than a core per vCPU). On this project's 2-vCPU
test machine one 256 x 256 matrix product on each vCPU at once runs 1.25-1.7x slower than one
alone (the two vCPUs are worth 1.2-1.6 cores), so two single-threaded workers compute 1.25-1.7x
slower than one, and three or four slower still: the step times of 3 and 4 local workers
imply their compute slowed 2.6-3.9x (BENCHMARKS.md, "auto against the bench"), where the
model, dividing by 2 cores, charged 1.5x and 2x.

Method: ``C = os.cpu_count()`` threads of this process (one intra-op thread each, as every
hpar CPU worker runs) each time ``reps`` single-threaded matrix products at once, after one
thread timed the same alone; the cores' worth is C x (time alone) / (mean time at once),
between 1 and C, the median of a few rounds. Products of ``size`` x ``size`` floats (about
0.3 ms each here) release the GIL for all but microseconds, so the threads compute in parallel
as processes would. About 0.2 s.

What it misses: the figure is a matrix product's. Larger products share the vCPUs better
(1024 x 1024: 1.6-1.9 cores' worth here), small kernels and Python between them worse: fitted
to the step times of 17 local runs of 3 and 4 workers, the cores' worth that predicts them best
is 1.1-1.3, where this probe reads 1.24-1.55.
"""
from __future__ import annotations

import os
import statistics
import threading
import time

import torch


def _products(size: int, reps: int, out: list, slot: int, start: threading.Barrier | None) -> None:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b   # warm: the first product allocates
    if start is not None:
        start.wait()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    out[slot] = time.perf_counter() - t0


def _round(cores: int, size: int, reps: int) -> float | None:
    """One reading: C x (one thread alone) / (mean of C threads at once), or None."""
    alone = [0.0]
    _products(size, reps, alone, 0, None)
    together, start = [0.0] * cores, threading.Barrier(cores)
    workers = [threading.Thread(target=_products, args=(size, reps, together, i, start), daemon=True)
               for i in range(cores)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60.0)
    if any(w.is_alive() for w in workers) or not alone[0] > 0 or not all(t > 0 for t in together):
        return None
    return cores * alone[0] / statistics.fmean(together)


def effective_cores(cores: int | None = None, size: int = 256, reps: int = 40, rounds: int = 7) -> float | None:
    """Cores' worth of compute ``cores`` (default ``os.cpu_count()``) processes computing at once
    get on this machine (module docstring): the median of ``rounds`` readings of C x alone / at
    once, each of ``reps`` products a thread, clamped to [1, C] (one reading on this project's
    VM: 1.0-1.8; the median of 5 or 7: 1.24-1.55). None for one core (nothing to share) or where
    the probe fails."""
    cores = cores or os.cpu_count() or 1
    if cores < 2:
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        readings = [_round(cores, size, reps) for _ in range(rounds)]
    except (RuntimeError, threading.BrokenBarrierError):
        return None
    finally:
        torch.set_num_threads(threads)
    if any(r is None for r in readings):
        return None
    return min(float(cores), max(1.0, statistics.median(readings)))
