"""How a failed process of a run is described, and which of several failures is the cause.

When one process dies its peers often fail after it (gloo aborts a process whose peer vanished
with SIGABRT, or it exits after printing that the connection was closed), so the supervisor
(launcher/run/supervisor.py) ranks the failures it sees and reports the root cause: a signal
from outside first, then a plain non-zero exit, then the consequences.
"""

from __future__ import annotations

import signal

# what gloo and NCCL print when a peer vanished: a process that says so failed because of it
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "NCCL communicator was aborted",
    "Broken pipe",
)


def describe_exit(code: int, signal_seen: int | None) -> str:
    """'exit code N' or 'killed by SIGNAME' for a process's exit status (the guard reports a
    child's death by signal N as exit code 128+N after an event naming the signal)."""
    sig = -code if code < 0 else (signal_seen if signal_seen and code == 128 + signal_seen else None)
    if sig:
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit code {code}"


def lost_host(host: str, how: str | None = None) -> str:
    """The failure of a process whose host stopped answering (its SSH connection broke, or
    ``how`` it was lost: a Ray node whose actor stopped answering)."""
    return (
        f"lost the connection to its host {host} ({how or 'link or host down, or sshd gone'}); its processes "
        "there stop by themselves (guard heartbeat)"
    )


def blame_order(code: int | None, signal_seen: int | None, peer_lost: bool) -> int:
    """0: killed by a signal from outside (SIGKILL, SIGTERM, SIGSEGV, ...); 1: a non-zero exit
    code; 2: a consequence of another failure: SIGABRT (how gloo ends a process whose peer
    vanished) or an exit after its output said a peer vanished (``PEER_LOST``). ``code``: the
    exit status (-N: signal N); ``signal_seen``: the signal its guard named. Ties go to the
    exit seen first (the caller's)."""
    sig = -code if code is not None and code < 0 else signal_seen
    if sig is None:
        return 2 if peer_lost else 1
    return 2 if sig == signal.SIGABRT else 0
