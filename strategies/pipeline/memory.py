"""Peak memory of one pipeline stage during training: what its schedule holds at once
(activations of the micro-batches in flight, stashed or predicted weight versions, gradients,
optimizer state), measured, not modelled.

On CUDA: ``torch.cuda.max_memory_allocated`` of the stage's device, its peak reset when
training starts (bytes held by tensors; the caching allocator's reserve is not counted).
On CPU: the process's resident-set high-water mark (``VmHWM`` in ``/proc/self/status``),
reset when training starts by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0,
proc(5)); the figure is that peak minus the resident set at the start, so the Python
interpreter, torch and the stage's weights are not counted. Where the mark cannot be reset
(not Linux, or /proc is read-only) the CPU figure is None rather than a guess.
"""
from __future__ import annotations

import torch


def _status_kib(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``), or None."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakMemory:
    """Usage: ``mem = PeakMemory(device); mem.start()`` before the training loop, then
    ``mem.peak_bytes()`` after it: bytes (int) the stage held at its peak above what it held
    at ``start()``, or None where it cannot be measured (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base: int | None = None

    def start(self) -> None:
        """Reset the high-water mark and record the current usage."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
        except OSError:
            self.base = None
            return
        rss = _status_kib("VmRSS")
        self.base = rss * 1024 if rss is not None else None

    def peak_bytes(self) -> int | None:
        """Peak bytes above the usage at :meth:`start` (>= 0), or None."""
        if self.base is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return max(0, torch.cuda.max_memory_allocated(self.device) - self.base)
        hwm = _status_kib("VmHWM")
        return max(0, hwm * 1024 - self.base) if hwm is not None else None
