"""The loopback link probe: what two gloo endpoints on this machine measure between them, for
the cost model of workers that share this host (strategies/plan/cluster.py's link model).

The two endpoints are two ``ProcessGroupGloo`` objects of a two-rank group, each driven by
its own thread of this process over a ``HashStore``. Their messages take the same path as
those of two worker processes: gloo's TCP transport over the loopback interface (the tensors
are copied into and out of the kernel's socket buffers; gloo releases the GIL while it
waits). Starting two processes instead cost seconds per ``hpar run``, most of it importing
torch twice, for the same figures (BENCHMARKS.md, "The cost model against measurement").

Between two hosts the endpoints must be two processes: :func:`probe_peer` is one of them
(``python -m hpar.strategies.plan.probe ADDR PORT RANK``), used by ``hpar bench`` to measure
the link of its emulated hosts (launcher/bench/emulate.py) instead of trusting the cap.
:func:`probe_sparse_round` is one of N processes, one per host (``... ADDR PORT RANK N``): the
fixed time of one sparse-gradient exchange over all N workers, which grows with N faster than
N - 1 latencies where the processes share busy cores (BENCHMARKS.md 14);
:func:`probe_gradient_exchange` (``... ADDR PORT RANK N ITEMS``) times a profiled job's whole
allreduce-sparse exchange (sparse tables and dense buckets in flight together) at its own sizes.

:func:`probe_requests` measures the CPU a small parameter-server request costs, with hpar's
own client and server at both ends: what a request costs in time when the processes share
busy cores (the cost model's ``request_cpu_s``, strategies/plan/costmodel_ps.py).
"""

from __future__ import annotations

import datetime
import math
import statistics
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from hpar.strategies.plan.costmodel import BUCKET_BYTES
from hpar.strategies.profile.records import Profile

_SMALL_TAG, _BIG_TAG = 0, 1


class LinkFigures(NamedTuple):
    """A probe's figures: ``bandwidth_Bps`` one way (bytes/s), ``latency_s`` (half a small
    message's round trip), ``allreduce_Bps`` (bytes over the time of a two-rank AllReduce) and
    ``allgather_Bps`` (a rank's bytes over the time of a two-rank AllGather, in which each rank
    sends its bytes while it receives the other's; None where it was not measured) and
    ``sparse_round_s`` (seconds of gloo's sparse AllReduce of a one-row gradient over all the
    hosts' workers, :func:`probe_sparse_round`; None where it was not measured)."""

    bandwidth_Bps: float
    latency_s: float
    allreduce_Bps: float
    allgather_Bps: float | None = None
    sparse_round_s: float | None = None


def _figures(out: dict, nbytes: int) -> LinkFigures:
    """LinkFigures from rank 0's median times (``out["figures"]``) of ``nbytes`` messages."""
    rtt, one_way, allreduce, allgather = out["figures"]
    return LinkFigures(
        nbytes / max(one_way - rtt, 1e-9),
        rtt / 2,
        nbytes / max(allreduce, 1e-9),
        None if allgather is None else nbytes / max(allgather, 1e-9),
    )


def _exchange(pg, rank: int, out: torch.Tensor, back: torch.Tensor, n: int) -> list[float]:
    """Seconds of ``n`` exchanges between the two ranks of ``pg``: rank 0 sends ``out`` and
    receives ``back``, rank 1 the reverse."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        if rank == 0:
            pg.send([out], 1, _BIG_TAG).wait()
            pg.recv([back], 1, _SMALL_TAG).wait()
        else:
            pg.recv([out], 0, _BIG_TAG).wait()
            pg.send([back], 0, _SMALL_TAG).wait()
        times.append(time.perf_counter() - t0)
    return times


def _timed(pg, small: torch.Tensor, start) -> float:
    """Seconds of the collective that ``start()`` begins (its work handle is waited on), both
    ranks starting it together: an AllReduce of ``small`` first lines them up."""
    pg.allreduce([small]).wait()
    t0 = time.perf_counter()
    start().wait()
    return time.perf_counter() - t0


def _endpoint(pg, rank: int, nbytes: int, pings: int, sends: int, out: dict, allgather: bool = False) -> None:
    try:
        small, big = torch.zeros(1), torch.zeros(nbytes // 4)
        # small round trips in three rounds spread over the probe: the latency is the least of
        # the rounds' medians, so a passing spell of other work on the cores spoils one round,
        # not the reading (the 2-host probe of one bench read 2.0 ms, of the next 0.07 ms)
        ping = lambda: _exchange(pg, rank, small, small.clone(), pings)[2:]  # the first pay for set-up
        rtt_rounds = [ping()]
        one_way = _exchange(pg, rank, big, small.clone(), sends + 1)
        rtt_rounds.append(ping())
        allreduce = [_timed(pg, small, lambda: pg.allreduce([big])) for _ in range(sends + 1)]
        gather = None
        if allgather:  # both directions busy at once, as in a sparse gradient's AllGather
            gathered = [torch.empty_like(big), torch.empty_like(big)]
            gather = [_timed(pg, small, lambda: pg.allgather([gathered], [big])) for _ in range(sends + 1)]
        rtt_rounds.append(ping())
        if rank == 0:  # the first large exchanges pay for page faults
            out["figures"] = (
                min(statistics.median(r) for r in rtt_rounds),
                statistics.median(one_way[1:]),
                statistics.median(allreduce[1:]),
                statistics.median(gather[1:]) if gather else None,
            )
    except Exception as exc:  # reported by probe_link in the caller's thread
        out[f"error{rank}"] = exc


def _in_threads(calls, timeout_s: float, out: dict) -> None:
    """Run ``calls`` ([(function, args)]) in threads and join them; raises RuntimeError when
    one stored an ``error*`` entry in ``out`` or outlived ``timeout_s``."""
    threads = [threading.Thread(target=f, args=a, daemon=True) for f, a in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    errors = [v for k, v in out.items() if k.startswith("error")]
    if errors or any(t.is_alive() for t in threads):
        why = type(errors[0]).__name__ if errors else "timeout"
        raise RuntimeError(f"link probe failed ({why}); pass --bandwidth and --latency")


def _loopback_pair(timeout_s: float) -> list:
    """The two ProcessGroupGloo endpoints of a two-rank group over a HashStore, in this process."""
    store, timeout = dist.HashStore(), datetime.timedelta(seconds=timeout_s)
    pgs: list = [None, None]
    out: dict = {}

    def connect(rank: int) -> None:
        try:
            pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, timeout)
        except Exception as exc:
            out[f"error{rank}"] = exc

    _in_threads([(connect, (r,)) for r in range(2)], timeout_s, out)
    return pgs


def probe_link(
    nbytes: int = 16 << 20, pings: int = 40, sends: int = 12, timeout_s: float = 60.0, allgather: bool = False
) -> LinkFigures:
    """Measure (bandwidth_Bps, latency_s, allreduce_Bps, allgather_Bps) of gloo over loopback TCP on this
    machine: latency = half the median round trip of a 4-byte message (the least of three
    rounds' medians, taken before, between and after the large transfers), bandwidth = ``nbytes``
    over the median one-way time of a large message minus one latency, allreduce_Bps =
    ``nbytes`` over the median time of an AllReduce of ``nbytes`` (the 2(N-1)/N * nbytes a
    ring moves for N = 2), allgather_Bps = ``nbytes`` over the median time of an AllGather in
    which each rank contributes ``nbytes`` (only with ``allgather``, else None: the cost model
    uses it between hosts, :func:`probe_peer`). Takes about a second. Raises RuntimeError if it fails."""
    pgs, out = _loopback_pair(timeout_s), {}
    _in_threads([(_endpoint, (pgs[r], r, nbytes, pings, sends, out, allgather)) for r in range(2)], timeout_s, out)
    return _figures(out, nbytes)


def probe_peer(
    addr: str, port: int, rank: int, nbytes: int = 2 << 20, pings: int = 20, sends: int = 4, timeout_s: float = 60.0
) -> LinkFigures | None:
    """One endpoint of :func:`probe_link`'s measurement between two processes (two hosts): rank
    0 hosts the rendezvous store at ``addr:port``. Returns rank 0's LinkFigures, None on rank 1.
    Raises RuntimeError if the exchange fails."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, 2, rank == 0, timeout=timeout)
    pg = dist.ProcessGroupGloo(store, rank, 2, timeout)
    out: dict = {}
    _endpoint(pg, rank, nbytes, pings, sends, out, allgather=True)
    errors = [v for k, v in out.items() if k.startswith("error")]
    if errors:
        raise RuntimeError(f"link probe failed ({type(errors[0]).__name__})")
    return None if rank else _figures(out, nbytes)


def probe_sparse_round(
    addr: str, port: int, rank: int, world: int, reps: int = 20, timeout_s: float = 60.0
) -> float | None:
    """One of ``world`` processes (one per host) measuring the fixed cost of a sparse-gradient
    exchange: the mean seconds, on rank 0, of gloo's sparse AllReduce (what DDP runs for an
    embedding's sparse gradient: an AllGather of the sizes, then of the row ids, then of the
    rows) of a one-row gradient of 64 floats over the ``world`` ranks, each timed after a
    small AllReduce lines the ranks up; the first two pay for set-up. The mean, not the
    median: the times are bimodal and a step pays their expectation; they grow with N faster
    than the cost model's two rounds of N - 1 latencies (BENCHMARKS.md, "The cost model against
    measurement"). Rank 0 hosts the rendezvous
    store at ``addr:port``. Returns the seconds on rank 0, None on the others. Raises
    RuntimeError if the exchange fails."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world, rank == 0, timeout=timeout)
    try:
        pg = dist.ProcessGroupGloo(store, rank, world, timeout)
        small = torch.zeros(1)
        grad = torch.sparse_coo_tensor(torch.tensor([[rank]]), torch.ones(1, 64), (world, 64), check_invariants=True)
        times = [_timed(pg, small, lambda: pg.allreduce([grad.clone()])) for _ in range(reps + 2)]
    except Exception as exc:
        raise RuntimeError(f"sparse AllReduce probe failed ({type(exc).__name__})") from exc
    return statistics.fmean(times[2:]) if rank == 0 else None


def exchange_items(profile: Profile) -> list[list[int]]:
    """What DDP exchanges per step for allreduce-sparse, in the order backward produces it
    (last layer first): an embedding table as ``[rows a batch touches (alpha x rows), row
    floats, table rows]``, each on its own, and the dense parameters between them as buckets
    ``[elements]`` of at most DDP's 25 MB (a run of dense layers shares buckets, as DDP fills
    them in that order)."""
    items: list[list[int]] = []
    bucket = 0  # bytes of the dense bucket being filled (float32: 4 bytes an element)
    for p in sorted(profile.params, key=lambda p: -p.layer):
        if not p.embedding_module:
            if bucket and bucket + p.bytes > BUCKET_BYTES:
                items.append([bucket // 4])
                bucket = 0
            bucket += p.bytes
            continue
        if bucket:
            items.append([bucket // 4])
            bucket = 0
        items.append([max(1, round(p.alpha * p.rows)), math.prod(p.shape[1:]), p.rows])
    return items + ([[bucket // 4]] if bucket else [])


def probe_gradient_exchange(
    addr: str, port: int, rank: int, world: int, items: list[list[int]], reps: int = 5, timeout_s: float = 120.0
) -> float | None:
    """One of ``world`` processes (one per host) timing allreduce-sparse's whole gradient
    exchange at a job's own sizes, as DDP runs it: ``items`` in the order backward produces
    them, each either ``[rows, dim, table_rows]`` (an embedding table's COO gradient of
    ``rows`` distinct rows of ``dim`` floats, the rows one worker's batch touches: gloo's sparse
    AllReduce) or ``[elements]`` (a bucket of dense float gradients: gloo's ring AllReduce), all
    in flight together. Returns the mean seconds on rank 0 over ``reps`` exchanges after one
    warm-up (the mean: over the emulated links an exchange's time varies from one to the
    next, and a step pays its expectation; each exchange after a small AllReduce lines the
    ranks up and a 0.1 s pause, so the links start idle as after a step's compute), None on
    the others.

    Why, where :func:`probe_sparse_round` and the two-rank AllGather rate already price an
    exchange: a link's rate depends on the messages' sizes and how many are in flight, which
    one figure per link cannot carry: sparse tables and a dense bucket in flight together took
    longer than the sum of the two apart (BENCHMARKS.md, "The cost model against measurement").
    Raises RuntimeError if the exchange fails."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world, rank == 0, timeout=timeout)
    try:
        pg = dist.ProcessGroupGloo(store, rank, world, timeout)
        small, g = torch.zeros(1), torch.Generator().manual_seed(rank)

        def grad(item: list[int]) -> torch.Tensor:
            if len(item) == 1:
                return torch.ones(item[0])
            rows, dim, n = item
            ids = torch.randperm(n, generator=g)[: min(rows, n)].sort().values[None]
            return torch.sparse_coo_tensor(ids, torch.ones(ids.shape[1], dim), (n, dim), check_invariants=True)

        def exchange() -> float:
            batch = [grad(item) for item in items]
            time.sleep(0.1)
            pg.allreduce([small]).wait()
            t0 = time.perf_counter()
            for work in [pg.allreduce([x]) for x in batch]:
                work.wait()
            return time.perf_counter() - t0

        times = [exchange() for _ in range(reps + 1)]
    except Exception as exc:
        raise RuntimeError(f"gradient exchange probe failed ({type(exc).__name__})") from exc
    return statistics.fmean(times[1:]) if rank == 0 else None


if __name__ == "__main__":  # python -m hpar.strategies.plan.probe ADDR PORT RANK [WORLD [ITEMS]]: rank 0 prints JSON
    import json
    import sys

    if len(sys.argv) > 5:  # ITEMS: JSON [[rows, dim, table_rows] or [elements], ...] (probe_gradient_exchange)
        seconds = probe_gradient_exchange(
            sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
        )
        if seconds is not None:
            print(json.dumps({"gradient_exchange_s": seconds}))
    elif len(sys.argv) > 4:
        seconds = probe_sparse_round(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        if seconds is not None:
            print(json.dumps({"sparse_round_s": seconds}))
    else:
        figures = probe_peer(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
        if figures is not None:
            print(json.dumps(figures._asdict()))
