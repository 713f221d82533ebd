"""Four recsys-like sparse gradients exchanged over N hosts: one after another, or all in flight.

The figures behind allreduce-sparse's fixed cost in the cost model (strategies/plan/costmodel.py,
``GLOO_THREADS``; BENCHMARKS.md 14): gloo's sparse AllReduce (what DDP runs for an embedding's
sparse gradient) of gradients shaped like examples/recsys.py's four tables (160, 160, 975 and 147
touched rows of 16 floats), timed per step (a) waiting for each before starting the next, (b) all
started at once, as DDP's communication hook does, and (c) one one-row gradient alone (what
``hpar bench`` probes, strategies/plan/probe.probe_sparse_round).

One process per host, e.g. on test hosts made by ``python scripts/testhosts.py up 8 --rate 50mbit
--prefix hx`` (first host 10.77.0.2)::

    for r in 0 1 2 3 4 5 6 7; do GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 ip netns exec hxh$r \\
        python scripts/bench_sparse_inflight.py 10.77.0.2 29710 $r 8 & done; wait

Rank 0 prints the mean and median milliseconds of each way over 20 steps (after 2 warm-up ones).
"""
from __future__ import annotations

import datetime
import statistics
import sys
import time

import torch
import torch.distributed as dist

TABLES = ((100_000, 160), (50_000, 160), (50_000, 975), (1_000, 147))   # (rows, rows touched per worker)
DIM = 16


def sparse_grad(rows: int, touched: int, gen: torch.Generator) -> torch.Tensor:
    """A coalesced (rows, DIM) sparse COO gradient with ``touched`` random rows."""
    ids = torch.randperm(rows, generator=gen)[:touched].sort().values
    return torch.sparse_coo_tensor(ids.unsqueeze(0), torch.randn(touched, DIM, generator=gen), (rows, DIM),
                                   check_invariants=True).coalesce()


def main(addr: str, port: int, rank: int, world: int, steps: int = 20) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore(addr, port, world, rank == 0, timeout=timeout)
    pg = dist.ProcessGroupGloo(store, rank, world, timeout)
    gen = torch.Generator().manual_seed(rank)
    grads = [sparse_grad(rows, k, gen) for rows, k in TABLES]
    one_row = sparse_grad(TABLES[0][0], 1, gen)
    small = torch.zeros(1)

    def sequential():
        for g in grads:
            pg.allreduce([g.clone()]).wait()

    def in_flight():
        for work in [pg.allreduce([g.clone()]) for g in grads]:
            work.wait()

    def one():
        pg.allreduce([one_row.clone()]).wait()

    for name, fn in (("one after another", sequential), ("all in flight", in_flight), ("one 1-row gradient", one)):
        times = []
        for _ in range(steps + 2):
            pg.allreduce([small]).wait()   # line the ranks up
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"{world} hosts  {name:20s} mean {statistics.fmean(times[2:]) * 1e3:7.1f} ms  "
                  f"median {statistics.median(times[2:]) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
