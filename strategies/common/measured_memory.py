"""Peak memory of a process during training, measured, not modelled: what the memory model of
``strategies/plan/memory_model.py`` is checked against (BENCHMARKS.md, "Memory").

A process's window opens after its imports (torch's lazy ones too, :func:`load_lazy_imports`)
and its process-group setup (:func:`start_process`), and closes at the end of its last training
step (:func:`freeze_process`). Worker 0's first ``evaluate()`` runs inside it under
:func:`outside_window`: its own peak is not training's, what it leaves alive is.
:meth:`PeakMemory.figures` reports the peak *above the window's baseline* (the memory model adds
the fixed overhead):

* CPU: the resident-set high-water mark (``VmHWM`` in ``/proc/self/status``, man proc(5)),
  reset by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), minus ``VmRSS`` at the
  reset, after ``malloc_trim(0)`` hands back what earlier phases freed; ``allocated_peak_bytes``
  is None (torch gives no CPU allocator statistics). A measuring process fixes glibc's mmap
  threshold at 1 MiB (``mallopt(M_MMAP_THRESHOLD)``, :func:`limit_retention`), so that large
  freed blocks leave the resident set instead of staying on the heap (docs/strategies.md,
  "Memory and --worker-memory").
* CUDA: ``torch.cuda.max_memory_allocated`` (``peak_bytes``, what the memory model predicts) and
  ``max_memory_reserved`` (what an out-of-memory error is measured against), reset with
  ``reset_peak_memory_stats``, minus what was held at the reset; the host's resident peak beside
  them (``rss_peak_bytes``).

Invariant: a later reset inside the window (a pipeline stage's own :class:`PeakMemory`) first
folds the window's peak so far into it (:func:`_reset`), so no reset erases the process's
high-water mark. Where the mark cannot be reset (not Linux, a read-only /proc) the CPU figures
are None rather than a guess.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import time

import torch


def status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes, or None."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library (None where it cannot be loaded)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> None:
    """glibc's ``malloc_trim(0)``: return the heap's free pages to the system, so that the
    resident set counts live memory (nothing where the C library has no such call)."""
    try:
        _libc().malloc_trim(0)
    except AttributeError:
        pass


TRIM_TIME_SHARE = 0.01  # the most of a process's time that paced trimming may take
_NEXT_TRIM = [0.0]  # perf_counter time before which release_freed_memory_paced does nothing
_TRIMS = [0]  # trims release_freed_memory_paced made in this process


def release_freed_memory_paced() -> None:
    """:func:`release_freed_memory` at the end of a training step (workers) or of a served step
    (parameter servers), but never more often than its own last duration / TRIM_TIME_SHARE
    after it: at most 1% of the process's time. Below the mmap threshold glibc keeps freed
    blocks inside its heaps, and steps whose tensors change size every step (a sparse
    gradient's rows, the ids a batch touches) leave them scattered where the heap's top cannot
    be cut (examples/lm.py's hybrid workers: BENCHMARKS.md, "Peak memory, predicted and
    measured"). What the memory model predicts is live memory, so a run
    that keeps its free heap resident is a run that uses more than it must."""
    now = time.perf_counter()
    if now < _NEXT_TRIM[0]:
        return
    release_freed_memory()
    _TRIMS[0] += 1
    _NEXT_TRIM[0] = now + (time.perf_counter() - now) / TRIM_TIME_SHARE


def trims() -> int:
    """How many times :func:`release_freed_memory_paced` trimmed in this process (its memory
    report's ``trims``)."""
    return _TRIMS[0]


def load_lazy_imports() -> None:
    """Import what torch imports on first use in every runtime, so that it lands in the
    baseline (it is code, not training state): an optimizer's first construction imports
    ``torch._dynamo`` and its dependencies, tens of MB of resident memory (BENCHMARKS.md, "Peak
    memory, predicted and measured")."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


MMAP_THRESHOLD = 1 << 20  # bytes: blocks at least this large are mapped, and returned when freed
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def limit_retention() -> None:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD (module docstring); nothing elsewhere."""
    try:
        _libc().mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except AttributeError:
        pass


def _clear_refs() -> bool:
    """Reset this process's VmHWM to its current resident set; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


_PROCESS: list = []  # the process window's PeakMemory, once start_process() ran


class PeakMemory:
    """Usage: ``mem = PeakMemory(device); mem.start()`` where the window opens, then
    ``mem.peak_bytes()`` (or :meth:`figures`) after it: bytes (int) held at the peak above
    what was held at ``start()``, or None where it cannot be measured (module docstring)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.base_rss: int | None = None
        self.base_alloc = self.base_reserved = 0
        self.folded = {"rss": 0, "alloc": 0, "reserved": 0}  # peaks seen before a later reset
        self.frozen: dict | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def start(self) -> None:
        """Reset the high-water marks (after folding the process window's) and record the
        current usage as the baseline."""
        limit_retention()
        release_freed_memory()
        ok = _reset(self.device)
        rss = status_bytes("VmRSS")
        self.base_rss = rss if ok and rss is not None else None
        if self.cuda:
            self.base_alloc = torch.cuda.memory_allocated(self.device)
            self.base_reserved = torch.cuda.memory_reserved(self.device)

    def _now(self) -> dict:
        """Peaks above the baseline since the last reset: rss, alloc, reserved (bytes or None)."""
        hwm = status_bytes("VmHWM") if self.base_rss is not None else None
        out = {"rss": max(0, hwm - self.base_rss) if hwm is not None else None, "alloc": None, "reserved": None}
        if self.cuda:
            torch.cuda.synchronize(self.device)
            out["alloc"] = max(0, torch.cuda.max_memory_allocated(self.device) - self.base_alloc)
            out["reserved"] = max(0, torch.cuda.max_memory_reserved(self.device) - self.base_reserved)
        return out

    def fold(self) -> None:
        """Keep the peaks so far (a reset of the marks follows)."""
        for key, value in self._now().items():
            if value is not None:
                self.folded[key] = max(self.folded[key], value)

    def figures(self) -> dict:
        """``peak_bytes`` (the allocator's peak on CUDA, the resident one on CPU),
        ``rss_peak_bytes``, ``allocated_peak_bytes`` and ``reserved_peak_bytes`` (CUDA only,
        else None), all above the baseline, and ``baseline_bytes`` (the resident set at the
        baseline); the window's figures once :meth:`freeze` ran."""
        if self.frozen is not None:
            return dict(self.frozen)
        now = self._now()
        peak = lambda key: None if now[key] is None else max(now[key], self.folded[key])
        rss = peak("rss")
        alloc, reserved = (peak("alloc"), peak("reserved")) if self.cuda else (None, None)
        return {
            "peak_bytes": alloc if self.cuda else rss,
            "rss_peak_bytes": rss,
            "allocated_peak_bytes": alloc,
            "reserved_peak_bytes": reserved,
            "baseline_bytes": self.base_rss,
        }

    def peak_bytes(self) -> int | None:
        """Peak bytes above the usage at :meth:`start` (>= 0), or None."""
        return self.figures()["peak_bytes"]

    def freeze(self) -> None:
        """Close the window: later readings return the figures of this moment."""
        if self.frozen is None:
            self.frozen = self.figures()


def _reset(device: torch.device) -> bool:
    """Reset the high-water marks of this process (and of ``device`` on CUDA), first folding
    the process window's peak so far into it; returns whether the CPU mark could be reset."""
    if _PROCESS and _PROCESS[0].frozen is None and _PROCESS[0].base_rss is not None:
        _PROCESS[0].fold()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    return _clear_refs()


def start_process(device: torch.device) -> PeakMemory:
    """Open this process's window (module docstring), after :func:`load_lazy_imports`."""
    load_lazy_imports()
    mem = PeakMemory(device)
    _PROCESS[:] = []
    mem.start()
    _PROCESS[:] = [mem]
    return mem


@contextlib.contextmanager
def outside_window():
    """Run code that is not training inside an open window without its transient peak counting:
    worker 0's first evaluate() (workers/worker.py; hybrid and ps in their runtime, whose
    evaluation pulls the served rows from the servers). The window's peak so far is kept and the
    marks are reset after it; the baseline stays, so what the code leaves alive still counts.
    Nothing without an open window."""
    mem = process_peak()
    if mem is None or mem.frozen is not None:
        yield
        return
    _reset(mem.device)  # folds the peak so far into the window
    try:
        yield
    finally:
        release_freed_memory()
        if mem.device.type == "cuda":
            torch.cuda.synchronize(mem.device)
            torch.cuda.reset_peak_memory_stats(mem.device)
        _clear_refs()  # no fold: the peak since the fold was the excluded code's


def process_peak() -> PeakMemory | None:
    """This process's window, or None before :func:`start_process`."""
    return _PROCESS[0] if _PROCESS else None


def freeze_process() -> None:
    """Close this process's window (end of its last training step); nothing without one."""
    if _PROCESS:
        _PROCESS[0].freeze()


def open_final_window() -> None:
    """After the last step, open a second window over the final write and what a runtime builds
    for the final ``evaluate()`` (worker 0's whole copy of a sharded or served model): read by
    :func:`final_peak_bytes`. Nothing without an open process window."""
    if _PROCESS:
        _PROCESS[0].freeze()
        final = PeakMemory(_PROCESS[0].device)
        final.start()
        _PROCESS[1:] = [final]


def final_peak_bytes() -> int | None:
    """Peak bytes above the process window's baseline from :func:`open_final_window` to now
    (the allocator's on CUDA, the resident set's on CPU), or None where not measured."""
    if len(_PROCESS) < 2:
        return None
    proc, final = _PROCESS
    peak = final.peak_bytes()
    if peak is None:
        return None
    if final.cuda:
        return final.base_alloc - proc.base_alloc + peak
    return None if proc.base_rss is None or final.base_rss is None else final.base_rss - proc.base_rss + peak
