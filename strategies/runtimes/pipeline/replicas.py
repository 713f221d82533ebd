"""Pipeline x data parallelism: K stages x R replicas (PipeDream's and Megatron-LM's hybrid).

A pipeline plan of ``world_size`` = K x R workers runs R copies (replicas) of a K-stage
pipeline. Replica r trains on its own shard of the data (``data(r, R, batch_size)``); the R
replicas of stage k average that stage's gradients with an AllReduce over the stage's replica
group before every optimizer step, so the R pipelines together equal one pipeline (and one
process) on the concatenation of the R batches (Narayanan et al., "PipeDream", SOSP 2019,
section 3.1, stage replication; Narayanan et al., "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", SC 2021, section 2.2: pipeline x data parallelism).

Rank layout (:class:`Grid`, strategies/plan/pipeline_grid.py), fixed by the plan's ``layout``:
``stages-adjacent`` (default, ``rank = r * K + k``: a pipeline within a host when K divides its
GPUs) or ``replicas-adjacent`` (``rank = k * R + r``: a stage's replica AllReduce within a host);
the planner (strategies/plan/costmodel_pipeline.py) takes whichever is predicted cheaper.

Invariant: the gradients are averaged here, with a bucketed AllReduce after the backward that
completes them, not by DDP (whose reducer would fire on a partial sum under 1F1B and never sees
the asynchronous schedules' ``functional_call`` leaves); replicas start from the same seeded
weights and apply the same averaged gradients, so they stay identical and a checkpoint is
written by replica 0 of each stage only. The reasoning, the process groups and the one limit:
docs/pipelines.md, "How it works".
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from hpar.strategies.common.groups import DEFAULT_BACKEND, dense_backend
from hpar.strategies.plan.pipeline_grid import Grid

BUCKET_BYTES = 25 << 20  # DDP's default bucket (bucket_cap_mb=25)


class StageReplicas:
    """This worker's stage replica group: gradient averaging and the step's mean loss.

    Construct it on every worker in the same order relative to other ``new_group`` calls
    (it creates one or two groups per stage, stage 0 first). ``rank``: this worker's rank;
    ``device_type``: "cpu" or "cuda"; ``is_remote``: default-group rank -> whether it runs on
    another host (for the bytes that leave the host). With one replica nothing is created and
    every method is a no-op.
    """

    def __init__(self, grid: Grid, rank: int, device_type: str, is_remote=lambda rank: False):
        self.grid = grid
        self.stage, self.replica = grid.coords(rank)
        self.n = grid.replicas
        self.group = self.control = None
        self.sent = 0.0  # bytes sent (= received) in gradient AllReduces since take()
        self.sent_remote = 0.0  # the part addressed to another host
        if self.n == 1:
            return
        backend = dense_backend(device_type)
        for k in range(grid.stages):
            ranks = grid.stage_ranks(k)
            dense = dist.new_group(ranks, backend=backend)
            control = dense if backend == DEFAULT_BACKEND else dist.new_group(ranks, backend=DEFAULT_BACKEND)
            if k == self.stage:
                self.group, self.control = dense, control
        mine = grid.stage_ranks(self.stage)
        self.ring_remote = is_remote(mine[(self.replica + 1) % self.n])  # gloo's and NCCL's ring successor

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Replace each parameter's ``.grad`` by its mean over the stage's replicas (a missing
        gradient counts as zeros): bucketed AllReduce, every bucket posted before any is
        awaited. Every replica must pass the same parameters in the same order."""
        if self.n == 1 or not params:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        pending = []
        for bucket in _buckets(params):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            pending.append((bucket, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
            nbytes = 2.0 * (self.n - 1) / self.n * flat.numel() * flat.element_size()
            self.sent += nbytes
            if self.ring_remote:
                self.sent_remote += nbytes
        for bucket, flat, work in pending:
            work.wait()
            flat.div_(self.n)
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()

    def mean_loss(self, loss: float) -> float:
        """The mean of ``loss`` over the stage's replicas (gloo, a CPU float64)."""
        if self.n == 1:
            return loss
        t = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(t, group=self.control)
        return float(t) / self.n

    def take(self) -> tuple[float, float]:
        """(bytes sent in AllReduces, of which to another host) since the last call; resets them.
        A ring AllReduce of B bytes sends and receives 2(R-1)/R * B per member."""
        out = (self.sent, self.sent_remote)
        self.sent = self.sent_remote = 0.0
        return out


def _buckets(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive parameters grouped by dtype and device into buckets of at most
    ``BUCKET_BYTES`` (a larger parameter is a bucket of its own)."""
    out, size, key = [], 0, None
    for p in params:
        nbytes = p.numel() * p.element_size()
        k = (p.grad.dtype, p.grad.device)
        if not out or k != key or size + nbytes > BUCKET_BYTES:
            out.append([])
            size, key = 0, k
        out[-1].append(p)
        size += nbytes
    return out
