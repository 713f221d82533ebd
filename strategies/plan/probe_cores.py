"""How many cores' worth of compute this machine gives processes that compute at once: the
cost model's cores per host for workers on this machine's CPU (``ClusterSpec.cores_per_host``,
read by ``costmodel.cpu_share`` and ``cpu_load``).

Why not ``os.cpu_count()``: a virtual machine's vCPUs may share physical cores (hyperthreads
of one core, or a host that gives the VM less than a core per vCPU), so single-threaded workers
computing at once each compute slower than one alone, by more than dividing by the vCPUs says
(BENCHMARKS.md, "The cost model against measurement" and "auto against the bench").

Method: ``C = os.cpu_count()`` threads of this process (one intra-op thread each, as every
hpar CPU worker runs) each time ``reps`` single-threaded matrix products at once, after one
thread timed the same alone; the cores' worth is C x (time alone) / (mean time at once),
between 1 and C, the median of a few rounds. Products of ``size`` x ``size`` floats (a
fraction of a millisecond each) release the GIL for all but microseconds, so the threads
compute in parallel as processes would.

What it misses: the figure is a matrix product's. Larger products share the vCPUs better,
small kernels and Python between them worse, so local runs of 3 and 4 workers are predicted
best by a lower cores' worth than this probe reads (BENCHMARKS.md, "The cost model against measurement").
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch


def _products(size: int, reps: int, out: list, slot: int, start: threading.Barrier | None) -> None:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm: the first product allocates
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
    workers = [
        threading.Thread(target=_products, args=(size, reps, together, i, start), daemon=True) for i in range(cores)
    ]
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
