"""What a process is busy with outside the training steps, for the launcher's phase deadline.

A step stall is told from the step count every heartbeat carries (launcher/run/health.py).
The rest of a run has no step to count: ``evaluate()`` (before training, every
``--eval-every`` steps, after the last step), drawing a worker's first batch, writing a
checkpoint or the trained model (``RUN_DIR/model``), a parameter server handling one request. Each of these runs
inside :func:`doing`, which records *what* the process is doing and *since when*; the
heartbeat thread (workers/report.py) adds ``doing`` and ``doing_s`` (seconds so far) to every
heartbeat, so the launcher sees a process that stays in one of them past ``--phase-timeout``
(default: ``--stall-timeout``) while its heartbeats go on, names it with what it was doing, and
ends the run (a frozen process goes silent instead, which the heartbeats' absence tells).

Waiting for peers is no phase of one's own: ``doing(None)`` around a barrier (the checkpoint
commit) suspends the deadline, so a process that waits for a slow peer is not the one blamed.
A worker announces each change with an event line as well (``announce``: its end is then seen
at once, not one heartbeat later); a server, whose requests come many times a step, does not.

One process-wide record (the heartbeat thread and the main thread share it), like the step
count the heartbeats carry; a process without a launcher (tests, the profiler) records it
unread. No torch import: workers/report.py imports this before torch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

_lock = threading.Lock()
_now: list = [None]  # (what, since monotonic) or None
_announce: list[Callable[[dict], None] | None] = [None]


def announce_with(emit: Callable[[dict], None] | None) -> None:
    """Send ``{"kind": "doing", "what": ...}`` to ``emit`` at every change made with
    ``announce=True`` (a worker: ``report.emit("event", ...)``); None stops it."""
    _announce[0] = emit


def _set(what: str | None, announce: bool) -> None:
    with _lock:
        _now[0] = None if what is None else (what, time.monotonic())
    if announce and _announce[0] is not None:
        _announce[0]({"kind": "doing", "what": what})


@contextlib.contextmanager
def doing(what: str | None, announce: bool = True):
    """Record ``what`` (a phrase that completes "stalled: ...", e.g. ``"in evaluate() before
    training"``) as this process's bounded activity for the block; None: waiting for peers,
    no deadline. The activity before it is restored afterwards, its clock starting again."""
    with _lock:
        before = _now[0]
    was = before[0] if before else None
    _set(what, announce and what != was)
    try:
        yield
    finally:
        _set(was, announce and what != was)


def tick() -> None:
    """Progress within the activity in progress (one more of many batches drawn): its clock
    starts again, so the deadline bounds each piece, not their sum."""
    with _lock:
        if _now[0] is not None:
            _now[0] = (_now[0][0], time.monotonic())


def current() -> dict:
    """``{"doing": what, "doing_s": seconds}`` of the activity in progress, ``{}`` when none."""
    with _lock:
        now = _now[0]
    if now is None:
        return {}
    return {"doing": now[0], "doing_s": round(time.monotonic() - now[1], 3)}
