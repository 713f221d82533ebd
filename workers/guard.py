"""``python -m hpar.workers.guard CMD...``: run one worker or server so that it can never
outlive the launcher.

The launcher starts the guard as the leader of a new session (locally with
``start_new_session``, remotely with ``setsid`` over SSH) with a pipe on its stdin; the guard
starts CMD in the same process group and watches the pipe. When the pipe closes (the launcher
exited, was SIGKILLed, or its SSH connection dropped) the guard sends SIGTERM to its process
group, waits ``HPAR_GUARD_GRACE`` seconds (default 3) and sends SIGKILL. With
``HPAR_GUARD_HEARTBEAT=S`` (remote processes) S seconds without a byte on the pipe count as a
closed pipe, so a host cut off from the launcher stops its processes too. Output is not copied:
CMD inherits the guard's stdout and stderr. The guard exits with CMD's exit code, or 128+N when
CMD died of signal N (printing an ``@hpar event`` line naming the signal first).
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time


_STOPPING = threading.Event()


def _on_sigterm(signum, frame) -> None:
    """The guard outlives its own SIGTERM round; any other SIGTERM ends it as by default.
    (Installed in the main thread: signal.signal cannot be called from the watcher thread.)"""
    if _STOPPING.is_set():
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _kill_group(grace: float) -> None:
    pgid = os.getpgrp()
    _STOPPING.set()  # the guard outlives the SIGTERM round
    try:
        os.killpg(pgid, signal.SIGTERM)
        time.sleep(grace)
    finally:
        os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m hpar.workers.guard CMD [ARGS...]", file=sys.stderr)
        return 2
    grace = float(os.environ.get("HPAR_GUARD_GRACE", "3"))
    signal.signal(signal.SIGTERM, _on_sigterm)
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    print(f'@hpar event {{"kind":"started","pid":{child.pid},"pgid":{os.getpgrp()}}}', flush=True)

    heartbeat = float(os.environ.get("HPAR_GUARD_HEARTBEAT", "0"))

    def watch_stdin() -> None:
        while True:
            # with HPAR_GUARD_HEARTBEAT=S (set by launcher/procs/ssh.py, which writes a byte every
            # second) S seconds of silence also count as a lost launcher: a dead link
            if heartbeat > 0 and not select.select([0], [], [], heartbeat)[0]:
                break
            if not os.read(0, 4096):
                break
        if child.poll() is None:
            _kill_group(grace)

    threading.Thread(target=watch_stdin, name="hpar-guard", daemon=True).start()
    code = child.wait()
    if code < 0:
        print(f'@hpar event {{"kind":"signal","signal":{-code},"name":"{signal.Signals(-code).name}"}}', flush=True)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
