"""Which process group carries what, on CPU (gloo) and on CUDA (NCCL).

One rule for every strategy, so that parameter servers never touch CUDA and nothing that lives
on the CPU reaches NCCL:

* the **default group** (every worker and every parameter server) is always **gloo**: the
  rendezvous, the AllGather of host indices, checkpoint barriers, the parameter
  servers' pull/push messages (CPU tensors: servers never touch CUDA), pipeline
  headers and losses. A process without CUDA, or with a torch built without NCCL, joins it.
* the workers' **dense group** (worker ranks ``0..N-1``) carries tensors that live on the
  worker's device: DDP's gradient buckets, the padded AllGather of sparse gradients, pipeline
  activations and gradients. It is **NCCL** when the workers use CUDA, gloo otherwise.
* the workers' **control group** (same ranks, always gloo) carries small CPU values among
  workers only: the final losses, RNG states for checkpoints. On CPU it is the dense group.

Groups are created with ``dist.new_group``, a collective over the default group: every
process of the run (servers included) calls :func:`worker_groups` with the same arguments and
in the same order. A server is a member of neither worker group, so it only ever *names*
the NCCL backend there; ``new_group`` does not build a backend on a non-member (checked with
a torch built without NCCL: tests/test_groups.py). This is the "or equivalent" of a
``cpu:gloo,cuda:nccl`` default group: with that, a server would have to construct an NCCL
backend, which a CPU-only torch cannot.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_BACKEND = "gloo"


def dense_backend(device_type: str) -> str:
    """Backend of the workers' dense group for workers on ``device_type`` ("cuda" or "cpu")."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device_type!r}: choose cpu or cuda")
    return "nccl" if device_type == "cuda" else "gloo"


def join_default_group(pg_rank: int, pg_world_size: int, timeout_s: int) -> None:
    """Join the run's default process group (gloo, for workers and servers alike; MASTER_ADDR
    and MASTER_PORT from the environment). ``timeout_s``: seconds a collective may wait."""
    dist.init_process_group(
        backend=DEFAULT_BACKEND, rank=pg_rank, world_size=pg_world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )


@dataclass(frozen=True)
class WorkerGroups:
    """The workers' groups (``None`` on a parameter server, which belongs to neither).
    ``dense``: tensors on the worker's device (NCCL on CUDA); ``control``: CPU values (gloo);
    ``backend``: the dense group's backend."""

    dense: object
    control: object
    backend: str


def worker_groups(num_workers: int, device_type: str) -> WorkerGroups:
    """Create the dense and control groups of workers ``0..num_workers-1`` (a collective over
    the default group: servers call it too). Raises ValueError for an unknown device type."""
    backend = dense_backend(device_type)
    ranks = list(range(num_workers))
    dense = dist.new_group(ranks, backend=backend)
    control = dense if backend == DEFAULT_BACKEND else dist.new_group(ranks, backend=DEFAULT_BACKEND)
    member = dist.get_rank() < num_workers
    return WorkerGroups(dense if member else None, control if member else None, backend)


def mean_over_workers(values: list[float], groups: WorkerGroups, world_size: int) -> list[float]:
    """The mean over the workers of each float in ``values`` (the same length on every worker),
    reduced over the gloo control group as a CPU float64 tensor: never a CPU tensor into NCCL."""
    import torch

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=groups.control)
    return (t / world_size).tolist()


def bf16_works() -> bool:
    """Whether this torch build's gloo AllReduces bfloat16 (pytorch/pytorch#111131: "Invalid
    scalar type" on some): one AllReduce on a one-process gloo group, no rendezvous. Every
    process of a run runs the same build, so the launcher's answer holds for the workers."""
    try:
        pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
        pg.allreduce([torch.zeros(2, dtype=torch.bfloat16)]).wait()
        return True
    except (RuntimeError, ValueError, TypeError):
        return False
