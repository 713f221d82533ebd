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
CMD died of signal N (printing an ``@hpar event`` line naming the signal first). With
``HPAR_GUARD_STATS=S`` (``hpar launch``, whose scripts report nothing) the guard prints a
heartbeat with CMD's CPU, memory and GPU memory every S seconds.

The guard is CMD's child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``): a process the
user's code starts in a session of its own (``start_new_session=True``), and whose parent then
exits, is re-parented to the guard rather than to init, so the guard and the launcher
(launcher/procs/local.py) still find it among the guard's descendants and stop it with the
group (workers/descendants.py); when CMD exits, the guard ends them itself and says which in an
``ended`` event. SIGUSR1 (the launcher's request for stacks, workers/report.install_stack_dump)
is ignored by the guard itself. With ``HPAR_HOLD_STORE=1`` rank 0's guard holds the run's
rendezvous store on MASTER_ADDR:MASTER_PORT before it starts CMD (workers/store.py
``guard_store``), and exits 1 naming the address when it cannot bind it.
"""

from __future__ import annotations

import ctypes
import json
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
    # its group gets this SIGTERM from the sender; what left the group would not, and once the
    # guard is gone it is nobody's: ended here (SIGKILL after 1 s), under srun as over SSH
    _stop_leftovers()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux); False where unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _outside_group() -> list:
    """The guard's live descendants that left its process group (a new session)."""
    try:
        from hpar.workers.descendants import outside_group

        return outside_group(os.getpid(), os.getpgrp())
    except Exception:  # psutil missing or the process table unreadable: the group still goes
        return []


def _signal_all(sig: int, extra: list) -> None:
    for p in extra:
        try:
            p.send_signal(sig)
        except Exception:
            pass
    os.killpg(os.getpgrp(), sig)


def _kill_group(grace: float) -> None:
    _STOPPING.set()  # the guard outlives the SIGTERM round
    extra = _outside_group()
    try:
        _signal_all(signal.SIGTERM, extra)
        os.killpg(os.getpgrp(), signal.SIGCONT)  # a stopped process acts on SIGTERM at once
        time.sleep(grace)
    finally:
        _signal_all(signal.SIGKILL, extra + _outside_group())


def _stop_leftovers(wait_s: float = 1.0) -> None:
    """CMD has exited, or the guard is told to stop: stop what CMD started in sessions of its
    own (SIGTERM, then SIGKILL after ``wait_s``) and tell the launcher which in an ``ended``
    event (it names them in one line); the launcher stops what is left in the group."""
    extra = _outside_group()
    if not extra:
        return
    from hpar.workers.descendants import end

    ended = end(extra, wait_s)
    try:
        print("@hpar event " + json.dumps({"kind": "ended", "processes": ended}), flush=True)
    except OSError:  # nobody reads any more (the launcher is gone)
        pass


def _report_stats(pid: int, every_s: float) -> None:
    """Every ``every_s`` s an ``@hpar heartbeat`` line (workers/report.py) with the CPU percent
    and resident memory of CMD and its children, and GPU memory where nvidia-smi lists them."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return
    handles: dict[int, psutil.Process] = {}
    while True:
        time.sleep(every_s)
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return
        cpu = rss = 0.0
        for p in procs:
            handle = handles.setdefault(p.pid, p)  # cpu_percent measures since the previous call on a handle
            try:
                cpu += handle.cpu_percent(interval=None)
                rss += handle.memory_info().rss
            except psutil.Error:
                continue
        figures = {"time": time.time(), "cpu_percent": cpu, "rss_bytes": int(rss)}
        gpu = _gpu_bytes({p.pid for p in procs})
        if gpu is not None:
            figures["gpu_bytes"] = gpu
        print("@hpar heartbeat " + json.dumps(figures), flush=True)


def _gpu_bytes(pids: set) -> int | None:
    """GPU memory used by ``pids`` (nvidia-smi's compute apps), None without nvidia-smi."""
    import shutil

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    used = [
        int(mib) * 2**20
        for pid, _, mib in (line.partition(",") for line in out.splitlines())
        if pid.strip().isdigit() and int(pid) in pids and mib.strip().isdigit()
    ]
    return sum(used)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m hpar.workers.guard CMD [ARGS...]", file=sys.stderr)
        return 2
    grace = float(os.environ.get("HPAR_GUARD_GRACE", "3"))
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)  # stacks are the child's to dump
    become_subreaper()
    try:  # rank 0 on a remote first host: the run's store, on MASTER_ADDR only (workers/store.py)
        from hpar.workers.store import guard_store

        store = guard_store()  # noqa: F841  (held until the guard exits)
    except Exception as exc:  # EADDRINUSE: the launcher starts again on another port
        print(f"hpar guard: {exc}", file=sys.stderr, flush=True)
        return 1
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
    stats = float(os.environ.get("HPAR_GUARD_STATS", "0"))
    if stats > 0:  # `hpar launch`: the script reports nothing itself, so the guard reports its figures
        threading.Thread(target=_report_stats, args=(child.pid, stats), name="hpar-guard-stats", daemon=True).start()
    code = child.wait()
    _stop_leftovers()
    if code < 0:
        print(f'@hpar event {{"kind":"signal","signal":{-code},"name":"{signal.Signals(-code).name}"}}', flush=True)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
