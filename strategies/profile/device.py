"""Which device ``hpar profile`` measures on, and the user's job as seen from that device.

The profile measures on the device the workers will use (issue 13, item 7): ``--device cuda``
puts the model and every batch on this machine's first visible GPU and times with CUDA events
(per layer, strategies/devices.DeviceClock) or with a synchronize around a timed region
(whole warm steps, optimizer probes); ``--device cpu`` measures on one CPU thread as an hpar
CPU worker runs. ``auto`` is ``cuda`` when this machine sees a GPU. A profile records the
device it measured on (``Profile.device``), and the plan says where its compute figures come
from (``Plan.compute``), so CPU figures are never taken for a GPU's silently.
"""

from __future__ import annotations

import statistics

import torch

from hpar.strategies.common.devices import DeviceClock

DEVICES = ("auto", "cpu", "cuda")


def profile_device(flag: str = "auto") -> torch.device:
    """The device ``hpar profile --device flag`` measures on. Raises ValueError (one line with
    the way out) for ``cuda`` on a machine that sees no GPU, or an unknown flag."""
    if flag not in DEVICES:
        raise ValueError(f"--device {flag!r}: choose auto, cpu or cuda")
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if flag == "cuda" and not has_gpu:
        raise ValueError(
            "--device cuda: this machine sees no GPU to profile on; run hpar profile on a GPU host, "
            "or pass --device cpu with --device-tflops (and --device-mem-gbps) to project a GPU"
        )
    return torch.device("cuda", 0) if flag == "cuda" or (flag == "auto" and has_gpu) else torch.device("cpu")


class OnDevice:
    """The user's job (strategies/job.Job) with every batch moved to ``device`` as hpar's
    workers move it (``context.move_to``); everything else is the job's own."""

    def __init__(self, job, device: torch.device):
        self.job, self.device = job, device

    def batches(self, rank: int, world_size: int, batch_size: int):
        from hpar.strategies.job.context import move_to

        for inputs, targets in self.job.batches(rank, world_size, batch_size):
            yield move_to(inputs, self.device), move_to(targets, self.device)

    def __getattr__(self, name):
        return getattr(self.job, name)


def data_seconds(on_dev: OnDevice, batch_size: int, workers: int, draws: int = 8) -> float:
    """Median seconds to draw one batch of ``batch_size`` from rank 0's ``data()`` stream and
    move it to the device (``on_dev``), as a worker does before every forward: the data
    pipeline's share of a step, which a worker pays whatever the strategy (BENCHMARKS.md, "The
    cost model against measurement"). The first draw, which
    may build caches, is not counted. Raises JobError from the user's ``data()``."""
    clock = DeviceClock(on_dev.device)  # now(): the host clock once the device's copies are done
    batches = on_dev.batches(0, workers, batch_size)
    next(batches)
    times = []
    for _ in range(draws):
        t0 = clock.now()
        next(batches)
        times.append(clock.now() - t0)
    return statistics.median(times)
