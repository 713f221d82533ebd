"""What a gloo exchange keeps resident: two spawned processes exchange rows each step, and each
reports its resident memory above its baseline after 10, 50 and 200 steps (BENCHMARKS.md, "Peak
memory, predicted and measured").

    MALLOC_MMAP_THRESHOLD_=1048576 python scripts/exchange_memory.py MODE [--bytes 2e6] [--steps 200] [--fixed]

MODE: ``p2p`` (each rank sends a random number of rows of 64 floats to the other and receives
the other's, as hybrid's pulls and pushes: ``batch_isend_irecv`` of the sizes, then of the rows),
``sparse`` (gloo's AllReduce of a sparse gradient of that many rows, as allreduce-sparse), or
``p2p-local`` / ``sparse-local`` (the same tensors made without an exchange: the control).
The row count varies by +-20% around ``--bytes`` each step unless ``--fixed``. Set
``MALLOC_MMAP_THRESHOLD_`` as hpar's measuring processes fix it (strategies/common/memory.py), or
glibc keeps freed large blocks on its heap and the figures say nothing of the exchange.
"""
from __future__ import annotations

import argparse

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DIM, MARKS, TABLE_ROWS = 64, (10, 50, 200), 100_000


def _exchange(mode: str, rank: int, rows: int) -> list:
    """One step's tensors (kept alive until the next step, as a training step's are)."""
    if mode in ("p2p", "p2p-local"):
        mine = torch.randn(rows, DIM)
        if mode == "p2p-local":
            return [mine, mine.clone()]
        size, other = torch.tensor([rows]), torch.zeros(1, dtype=torch.long)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, size, 1 - rank), dist.P2POp(dist.irecv, other, 1 - rank)]):
            work.wait()
        theirs = torch.empty(int(other), DIM)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, 1 - rank), dist.P2POp(dist.irecv, theirs, 1 - rank)]):
            work.wait()
        return [mine, theirs]
    ids = torch.randint(0, TABLE_ROWS, (1, rows))
    grad = torch.sparse_coo_tensor(ids, torch.randn(rows, DIM), (TABLE_ROWS, DIM))
    if mode == "sparse-local":
        return [(grad + grad).coalesce()]
    dist.all_reduce(grad)
    return [grad]


def _worker(rank: int, args, port: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.barrier()
    me, g = psutil.Process(), torch.Generator().manual_seed(rank)
    base, marks, kept = me.memory_info().rss, {}, []
    for step in range(1, args.steps + 1):
        scale = 1.0 if args.fixed else 0.8 + 0.4 * torch.rand(1, generator=g).item()
        kept = _exchange(args.mode, rank, max(1, int(args.bytes * scale) // (4 * DIM)))
        if step in MARKS:
            marks[step] = round((me.memory_info().rss - base) / 1e6, 1)
    del kept
    dist.barrier()
    queue.put((rank, marks))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("p2p", "sparse", "p2p-local", "sparse-local"))
    parser.add_argument("--bytes", type=float, default=2e6, help="bytes of rows a rank sends per step (mean)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fixed", action="store_true", help="the same row count every step")
    args = parser.parse_args()
    from hpar.strategies.plan.cluster import free_port
    queue = mp.get_context("spawn").Queue()
    mp.start_processes(_worker, args=(args, free_port(), queue), nprocs=2, start_method="spawn", join=True)
    print(args.mode, f"{args.bytes:g} bytes", "fixed" if args.fixed else "varying",
          "MB above baseline after steps", dict(sorted(queue.get() for _ in range(2))))


if __name__ == "__main__":
    main()
