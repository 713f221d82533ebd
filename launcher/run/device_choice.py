"""Which device the workers of a run use, decided per host from what each host reports.

A worker uses one GPU (``cuda:LOCAL_RANK``, NCCL among workers) or the CPU (gloo). The GPU
count of a host is what that host sees: its preflight row (``/dev/nvidiaN`` devices limited
by its CUDA_VISIBLE_DEVICES) for hosts reached over SSH, ``torch.cuda.device_count()`` (which
honours CUDA_VISIBLE_DEVICES) for this machine alone; never the launcher's own GPUs for
another host. Parameter servers always run on the CPU (gloo), whatever the workers use.

Rules (``--device``):

* ``cpu``: every worker on the CPU.
* ``cuda``: every host must see at least one GPU per worker it runs; otherwise a one-line
  ValueError naming the host.
* ``auto`` (default): CUDA when every host with workers sees a GPU per worker; the CPU when no
  host sees a GPU; a host that sees GPUs, but fewer than its workers, is refused (one GPU per
  worker: lower ``--gpus`` or the host's slots, or pass ``--device cpu``), and so is a mix
  of hosts with and without GPUs (NCCL needs every worker on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class HostDevices:
    """One host of the run: ``workers`` it runs, ``gpus`` it sees, and the ``device`` chosen."""

    host: str
    workers: int
    gpus: int
    device: str


def local_gpus() -> int:
    """GPUs this machine's processes see (CUDA_VISIBLE_DEVICES honoured); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_devices(hosts: list[tuple[str, int, int]], flag: str = "auto") -> tuple[str, tuple[HostDevices, ...]]:
    """``(device, per host)`` for ``hosts`` = [(name, workers on it, GPUs it sees)] (hosts
    without workers left out) under ``--device flag``. Raises ValueError (one line naming
    the host, the counts and the fix) when the hosts cannot run it."""
    if flag not in DEVICES:
        raise ValueError(f"--device {flag!r}: choose auto, cpu or cuda")
    if flag == "cpu":
        return "cpu", tuple(HostDevices(h, w, g, "cpu") for h, w, g in hosts)
    short = [(h, w, g) for h, w, g in hosts if g < w]
    if flag == "cuda" and short:
        h, w, g = short[0]
        raise ValueError(
            f"--device cuda: host {h} sees {g} GPU(s) for {w} worker(s) (one GPU per worker); "
            f"lower --gpus or its slots to {g}, or pass --device cpu"
        )
    if flag == "auto":
        partial = [(h, w, g) for h, w, g in short if g > 0]
        if partial:
            h, w, g = partial[0]
            raise ValueError(
                f"host {h} sees {g} GPU(s) but runs {w} worker(s) (one GPU per worker); lower --gpus or "
                f"its slots to {g} per host, or pass --device cpu"
            )
        with_gpu = [h for h, w, g in hosts if g >= w]
        if not with_gpu or not any(g for _, _, g in hosts):
            return "cpu", tuple(HostDevices(h, w, g, "cpu") for h, w, g in hosts)
        if short:
            h, w, g = short[0]
            raise ValueError(
                f"host {h} sees no GPU while {with_gpu[0]} runs its workers on GPUs; NCCL needs every "
                "worker on a GPU: pass --device cpu, or leave that host out"
            )
    return "cuda", tuple(HostDevices(h, w, g, "cuda") for h, w, g in hosts)


def describe(device: str, per_host: tuple[HostDevices, ...], servers: int) -> str:
    """One line saying which device and backend each host's processes use."""
    parts = []
    for d in per_host:
        if d.device == "cuda":
            parts.append(f"{d.host}: {d.workers} worker(s) on cuda:0..{d.workers - 1} of {d.gpus} GPU(s)")
        else:
            parts.append(f"{d.host}: {d.workers} CPU worker(s)")
    among = "NCCL among workers" if device == "cuda" else "gloo among workers"
    tail = f"; {servers} parameter server(s) on CPU (gloo)" if servers else ""
    return f"devices: {', '.join(parts)} ({among}{tail})"
