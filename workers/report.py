"""The one-way protocol from a worker or server process to the launcher: tagged JSON lines
on stdout. Works the same for a local child and for a process behind SSH, since the
launcher reads every process's stdout line by line anyway.

A line is ``@hpar <kind> <json>``; kinds: ``metric`` (one logging interval, see
StepMeter), ``heartbeat`` (psutil figures, every few seconds), ``summary`` (worker rank 0,
once, at the end), ``event`` (free-form notice, e.g. "checkpoint written").
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time

import psutil

from hpar.strategies.common import activity

TAG = "@hpar "
_lock = threading.Lock()


def _clean(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def emit(kind: str, payload: dict) -> None:
    """Write one tagged line to stdout and flush (thread-safe)."""
    line = TAG + kind + " " + json.dumps(_clean(payload), separators=(",", ":"))
    with _lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def parse(line: str) -> tuple[str, dict] | None:
    """``(kind, payload)`` for a tagged line, None for an ordinary log line."""
    if not line.startswith(TAG):
        return None
    try:
        kind, _, body = line[len(TAG) :].partition(" ")
        return kind, json.loads(body)
    except ValueError:
        return None


_PROCESS: list[psutil.Process] = []


def _process() -> psutil.Process:
    """This process's psutil handle, kept: ``cpu_percent`` measures since the previous call
    on the same handle (a fresh handle always answers 0.0)."""
    if not _PROCESS or _PROCESS[0].pid != os.getpid():
        _PROCESS[:] = [psutil.Process(os.getpid())]
        _PROCESS[0].cpu_percent(interval=None)
    return _PROCESS[0]


def process_figures(device=None) -> dict:
    """CPU percent since the previous call (100 = one core busy) and resident memory (bytes)
    of this process, and the memory allocated on ``device`` (a CUDA torch.device: the
    worker's own GPU; the heartbeat thread's current device would be GPU 0) where present."""
    proc = _process()
    figures = {"cpu_percent": proc.cpu_percent(interval=None), "rss_bytes": proc.memory_info().rss}
    try:
        import torch

        if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
            figures["gpu_bytes"] = torch.cuda.memory_allocated(device)
    except Exception:  # pragma: no cover - GPU figures are best effort
        pass
    return figures


STACK_SIGNAL = "SIGUSR1"
_STEP = [0]


def set_step(step: int) -> None:
    """Record the run's step count (after each training step); heartbeats carry it, so the
    launcher sees per-step progress of every process between metric reports."""
    _STEP[0] = step


def install_stack_dump() -> None:
    """On SIGUSR1, write every thread's Python stack to stderr (``faulthandler``; works while
    the main thread is blocked in C code such as a gloo collective). The launcher sends it to
    a stalled run before teardown and groups the stacks it reads back (launcher/run/stacks.py)."""
    import faulthandler
    import signal

    faulthandler.register(getattr(signal, STACK_SIGNAL), all_threads=True, chain=False)


def start_heartbeat(every_s: float | None = None, device=None, threads: int | None = None) -> threading.Event:
    """Emit a ``heartbeat`` line every ``every_s`` seconds (default ``HPAR_HEARTBEAT_S``, else
    2) from a daemon thread; set the returned event to stop it. The launcher counts a process
    whose heartbeats stop as stalled, whatever its step (launcher/run/health.py); each heartbeat
    also says what the process is busy with outside its steps (strategies/common/activity.py), which
    has a deadline of its own. ``device``:
    the worker's torch.device (GPU memory figures); ``threads``: its CPU threads, in every
    heartbeat (metrics.jsonl then says what each process got)."""
    every_s = every_s or float(os.environ.get("HPAR_HEARTBEAT_S", "2"))
    stop = threading.Event()
    _process()  # prime the CPU counter
    extra = {"threads": threads} if threads is not None else {}

    def beat():
        emit(
            "heartbeat", {"time": time.time(), "at_step": _STEP[0], **activity.current(), **process_figures(), **extra}
        )
        while not stop.wait(every_s):
            emit(
                "heartbeat",
                {"time": time.time(), "at_step": _STEP[0], **activity.current(), **process_figures(device), **extra},
            )

    threading.Thread(target=beat, name="hpar-heartbeat", daemon=True).start()
    return stop


def exit_process(code: int, announce: bool = True) -> None:
    """Flush stdout/stderr and end the process at once with exit status ``code``.

    Code 0 is announced first with an ``exit`` event (``announce``): a worker that leaves with
    0 without it (``sys.exit(0)`` in the user's code, which ends here with ``announce=False``)
    ended early, and the launcher says so.

    Called by worker and server processes after their process group is destroyed and every
    file they write is renamed into place. Skipping interpreter finalization is deliberate:
    gloo's C++ threads can still hold tensors then, and tearing those down while Python
    shuts down aborts a finished process now and then ("terminate called without an active
    exception", SIGABRT; see pytorch/pytorch PR 179291), which the launcher must read as a
    failure.
    """
    if code == 0 and announce:
        emit("event", {"kind": "exit", "code": 0})
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
