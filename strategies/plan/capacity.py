"""How much memory a worker and a parameter server may use (``--worker-memory GB``,
``--server-memory GB``, 10^9 bytes), and the check of a plan's predicted peaks against it
before anything starts (strategies/plan/memory_model.py predicts them).

Defaults, where the flag is not given and the processes run on this machine: a GPU worker
gets what its device reports (``torch.cuda.mem_get_info``'s total of the first visible GPU);
a CPU worker and a server get this host's RAM divided by the hpar processes that share it
(workers and servers on this host). For hosts hpar does not run on (a projection such as
``--hosts 8x6``, or remote hosts) there is no default: plans are then not checked for memory
unless the flags say what the devices hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpar.strategies.plan.memory_model import GB


@dataclass(frozen=True)
class Capacity:
    """Bytes a worker (its device) and a server (its host memory) may hold; None: unknown."""

    worker_bytes: float | None = None
    server_bytes: float | None = None


def from_flags(worker_gb: float | None, server_gb: float | None) -> Capacity:
    """The capacity the flags give (GB of 10^9 bytes). Raises ValueError naming the flag for a
    value that is not positive."""
    for flag, value in (("--worker-memory", worker_gb), ("--server-memory", server_gb)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be a positive number of GB (10^9 bytes), got {value:g}")
    return Capacity(
        worker_gb * GB if worker_gb is not None else None, server_gb * GB if server_gb is not None else None
    )


def with_defaults(given: Capacity, local: bool, device: str, procs_on_host: int) -> Capacity:
    """``given`` with this machine's defaults (module docstring) for what it leaves open, where
    the processes run here (``local``) on ``device`` ("cpu"/"cuda"), ``procs_on_host`` of them
    (workers and servers) on the busiest host."""
    if not local:
        return given
    import psutil

    share = psutil.virtual_memory().total / max(1, procs_on_host)
    worker = given.worker_bytes
    if worker is None:
        worker = _gpu_total() if device == "cuda" else share
    return Capacity(worker, given.server_bytes if given.server_bytes is not None else share)


def _gpu_total() -> float | None:
    """Bytes of the first visible GPU (None without one)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return float(torch.cuda.mem_get_info(0)[1])


def misfit(memory: dict, capacity: Capacity) -> str:
    """Why a plan's predicted peaks (its ``memory`` dict) do not fit ``capacity`` ("" when they
    do, or a side is unknown): strategies/plan/memory_model.misfit."""
    from hpar.strategies.plan.memory_model import misfit as plan_misfit

    return plan_misfit(memory, capacity.worker_bytes, capacity.server_bytes)
