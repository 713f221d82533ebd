"""The fixed time of a small gloo collective among the N worker processes of this host: what
one AllReduce, AllGather or ReduceScatter costs before its bytes, for the cost model of
workers that share this machine (``ClusterSpec.allreduce_fixed_s`` and its peers; a sparse
gradient's AllReduce, ``ClusterSpec.sparse_round_s``).

Why not N - 1 latencies: the link probe's latency (strategies/plan/probe.py: half a 4-byte
round trip) is one message, while a gloo collective of a few kilobytes among a host's
processes costs many wake-ups of gloo's work threads on shared cores, several times that, and
the same between N threads of one process as between N processes (the figures:
BENCHMARKS.md, "Measured collectives and FSDP's own work"). DDP pays it per gradient bucket;
FSDP three times per unit per step; on a small model that is most of the step.

The N endpoints are ``ProcessGroupGloo`` objects of one N-rank group over a ``HashStore``, each
driven by its own thread of this process (as the link probe's two): starting N processes would
cost seconds of importing torch for the same figures.
"""

from __future__ import annotations

import datetime
import statistics
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

MAX_ENDPOINTS = 16  # more threads than this measure the probe's own GIL, not gloo


class CollectiveTimes(NamedTuple):
    """Seconds of one small collective over the probed N ranks (means: a step pays the slow ones
    too); ``sparse_round_s``: gloo's sparse AllReduce of a one-row gradient, what DDP runs for an
    embedding's sparse gradient (three AllGathers: sizes, row ids, rows)."""

    allreduce_s: float
    allgather_s: float
    reduce_scatter_s: float
    sparse_round_s: float


def _endpoint(pg, rank: int, n: int, numel: int, reps: int, warm: int, out: dict) -> None:
    try:
        x, gathered = torch.zeros(numel), torch.zeros(numel * n)
        row = torch.sparse_coo_tensor(torch.tensor([[rank]]), torch.ones(1, 16), (n, 16), check_invariants=True)
        kinds = (
            lambda: pg.allreduce([x]),
            lambda: pg._allgather_base(gathered, x),
            lambda: pg._reduce_scatter_base(x, gathered),
            lambda: pg.allreduce([row.clone()]),
        )
        means = []
        for start in kinds:
            times = []
            for i in range(warm + reps):
                t0 = time.perf_counter()
                start().wait()
                if i >= warm:
                    times.append(time.perf_counter() - t0)
            means.append(statistics.fmean(times))
        if rank == 0:
            out["times"] = CollectiveTimes(*means)
    except Exception as exc:  # reported by probe_collectives in the caller's thread
        out[f"error{rank}"] = exc


def probe_collectives(
    n: int, nbytes: int = 4096, reps: int = 30, warm: int = 5, timeout_s: float = 60.0
) -> CollectiveTimes | None:
    """The mean seconds of a gloo AllReduce, AllGather (each rank ``nbytes``), ReduceScatter
    (each rank's share ``nbytes``) and sparse AllReduce (a row of 16 floats each) over ``n`` ranks of this process (module docstring), each
    timed ``reps`` times after ``warm`` untimed ones (a fraction of a second per rank).
    None for ``n`` < 2, ``n`` > MAX_ENDPOINTS, or when the probe fails or outlives ``timeout_s``
    (the cost model then keeps its N - 1 latencies)."""
    import threading

    if n < 2 or n > MAX_ENDPOINTS:
        return None
    store, timeout, out = dist.HashStore(), datetime.timedelta(seconds=timeout_s), {}
    pgs: list = [None] * n

    def run(rank: int) -> None:
        try:
            pgs[rank] = dist.ProcessGroupGloo(store, rank, n, timeout)
        except Exception as exc:
            out[f"error{rank}"] = exc
            return
        _endpoint(pgs[rank], rank, n, max(1, nbytes // 4), reps, warm, out)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of the run's processes on shared cores has
    try:
        started = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
        for t in started:
            t.start()
        for t in started:
            t.join(timeout_s)
        if any(t.is_alive() for t in started) or any(k.startswith("error") for k in out):
            return None
    finally:
        torch.set_num_threads(threads)
    return out.get("times")
