"""Sparse gradients without a sparse AllReduce: the padded AllGather that Horovod uses for
``IndexedSlices`` (Sergeev & Del Balso, "Horovod: fast and easy distributed deep learning in
TensorFlow", 2018, section 4; horovod/torch/mpi_ops.py ``sparse_allreduce_async``).

NCCL has no sparse AllReduce (gloo's is itself an AllGather). Each worker coalesces its
embedding gradient into (row ids ``(k,)``, rows ``(k, dim)``), the workers AllGather their
``k`` (one int64 each), pad ids and rows to the largest ``k`` so that every AllGather has one
shape (NCCL needs equal sizes), AllGather both, drop the padding, and sum the rows by id; the
result is divided by N (a mean, as DDP's dense buckets). Everything stays on the gradient's
device, so this runs on NCCL as on gloo; ``allreduce-sparse`` uses it on CUDA and, when
the plan's ``sparse_exchange`` is ``"allgather-padded"``, on gloo too (how the tests run the NCCL
path on this CPU machine).

Bytes per worker: it sends its padded ids and rows (and its ``k``) to each of the N-1 peers
and receives as much: ``(N-1) * (8 + K_max * (8 + row bytes))``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hpar.strategies.specs.decision import Plan

EXCHANGES = ("gloo-sparse", "allgather-padded")


def sparse_exchange(plan: Plan, dense_backend: str) -> str:
    """How ``allreduce-sparse`` exchanges sparse gradients: ``plan.sparse_exchange`` when
    given, else gloo's sparse AllReduce on gloo and the padded AllGather on NCCL. Raises
    ValueError for an unknown name or gloo's sparse AllReduce on NCCL."""
    chosen = plan.sparse_exchange or ("allgather-padded" if dense_backend == "nccl" else "gloo-sparse")
    if chosen not in EXCHANGES:
        raise ValueError(f"plan sparse_exchange {chosen!r}: choose one of {', '.join(EXCHANGES)}")
    if chosen == "gloo-sparse" and dense_backend == "nccl":
        raise ValueError("plan sparse_exchange 'gloo-sparse' cannot run on NCCL (CUDA workers); use 'allgather-padded'")
    return chosen


def padded_allgather_bytes(k_max: int, row_bytes: int, world_size: int) -> float:
    """Bytes one worker sends (and receives) in the padded AllGather: ``(N-1)(8 + K_max(8 + row bytes))``."""
    return float((world_size - 1) * (8 + k_max * (8 + row_bytes)))


def padded_allgather_mean(grad: torch.Tensor, group, world_size: int) -> tuple[torch.Tensor, int]:
    """Mean over the workers of ``group`` of the sparse COO gradient ``grad`` (rows sparse:
    ``sparse_dim == 1``), as a coalesced sparse tensor on ``grad``'s device; also returns
    ``K_max``, the most rows any worker contributed (for the byte count). A collective."""
    g = grad.coalesce()
    ids, rows = g.indices()[0], g.values()
    k = torch.tensor([ids.numel()], dtype=torch.int64, device=rows.device)
    sizes = [torch.empty_like(k) for _ in range(world_size)]
    dist.all_gather(sizes, k, group=group)
    sizes = [int(s) for s in torch.cat(sizes).tolist()]  # one host sync: the padded size
    k_max = max(sizes)
    pid = ids.new_zeros(k_max)
    pid[: ids.numel()] = ids
    prow = rows.new_zeros((k_max,) + tuple(rows.shape[1:]))
    prow[: ids.numel()] = rows
    all_ids = [torch.empty_like(pid) for _ in range(world_size)]
    all_rows = [torch.empty_like(prow) for _ in range(world_size)]
    dist.all_gather(all_ids, pid, group=group)
    dist.all_gather(all_rows, prow, group=group)
    cat_ids = torch.cat([i[:s] for i, s in zip(all_ids, sizes)])
    cat_rows = torch.cat([r[:s] for r, s in zip(all_rows, sizes)])
    out = torch.sparse_coo_tensor(cat_ids.unsqueeze(0), cat_rows / world_size, g.shape).coalesce()
    return out, k_max


def padded_allgather_hook(state, bucket):
    """DDP communication hook for ``allreduce-sparse`` on NCCL: dense buckets get a mean
    AllReduce (ring bytes), sparse ones :func:`padded_allgather_mean`. ``state`` is
    (ByteMeter, N, group, whether the ring successor is on another host); ``bucket`` a
    dist.GradBucket (unannotated: DDP rejects string annotations)."""
    from hpar.strategies.job.context import DENSE, ring_allreduce_bytes

    counter, world_size, group, remote = state
    buf = bucket.buffer()
    if not buf.is_sparse:
        b = ring_allreduce_bytes(buf.numel() * buf.element_size(), world_size)
        counter.add(DENSE, sent=b, recv=b, remote=remote)
        buf.div_(world_size)
        return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])
    out, k_max = padded_allgather_mean(buf, group, world_size)
    row_bytes = buf.element_size() * math.prod(buf.shape[1:])
    b = padded_allgather_bytes(k_max, row_bytes, world_size)
    counter.add(DENSE, sent=b, recv=b, remote=remote)
    fut = torch.futures.Future()
    fut.set_result(out)
    return fut
