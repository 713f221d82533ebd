"""What runs inside the small Ray actor that starts one process of a run on its node
(launcher/procs/ray_actor.py creates it): the role sshd plays for a process started over SSH.

The agent runs the very command hpar runs over SSH (launcher/procs/ssh.py ``remote_command``:
``cd CWD && PY -c BOOT PY -m hpar.workers.guard ...``, with this node's Python) under
``/bin/sh -c``, writes the environment as the first line of its stdin (``remote_environment``:
never in argv or a file), keeps the pipe open and writes one heartbeat byte each time the
launcher reads from it (:meth:`ProcessAgent.read`). So the guard stops its process group when
the launcher stops calling (``HPAR_GUARD_HEARTBEAT`` seconds of silence) or when the agent
dies (its pipe closes): Ray kills the actors of a driver that died, and a node's workers end
with its raylet. Output lines are kept until the launcher reads them; signals go to the
recorded process group only.

The child's environment is the actor's without what Ray sets for its own workers (``RAY_*``,
the accelerator masks, ``OMP_NUM_THREADS``): the ranks choose their devices from
``LOCAL_RANK`` as on any other host. ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` name the
interface that holds the node's Ray address unless the environment gives them.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

_RAY_SET = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "NEURON_RT_VISIBLE_CORES",
    "OMP_NUM_THREADS",
)
MAX_LINES = 2000  # lines one read returns at most


def base_environment(environ=None) -> dict:
    """The child's starting environment: ``environ`` (the actor's) without Ray's own variables."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith("RAY_") and k not in _RAY_SET}


def interface_of(address: str) -> str | None:
    """The name of this machine's interface that holds ``address`` (None: none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


class ProcessAgent:
    """One process of a run on this node (see the module docstring). Created by the launcher
    with ``max_concurrency`` > 1, so that reads, signals and checks answer while a read waits."""

    def __init__(self):
        self._popen: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()
        self._eof = threading.Event()
        self._closed = False
        self._last_beat = 0.0
        self._lock = threading.Lock()

    def start(self, spec, node_ip: str, cwd: str, heartbeat_s: float) -> int:
        """Start ``spec`` (a ProcessSpec) under its guard; returns the pid of its shell."""
        from dataclasses import replace
        from hpar.launcher.procs.ssh import remote_command, remote_environment

        spec = replace(spec, env={"HPAR_GUARD_HEARTBEAT": str(heartbeat_s), **spec.env})
        env = remote_environment(spec)
        ifname = interface_of(node_ip)
        if ifname:
            for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                env.setdefault(key, ifname)
        cwd = cwd if os.path.isdir(cwd) else os.path.expanduser("~")
        command = remote_command(spec, sys.executable, cwd)
        self._popen = subprocess.Popen(
            ["/bin/sh", "-c", command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=base_environment(),
            bufsize=0,
        )
        self._write(json.dumps(env).encode() + b"\n")  # first, as over SSH (ssh.py environment_line)
        self._last_beat = time.monotonic()
        threading.Thread(target=self._read, daemon=True).start()
        return self._popen.pid

    def _write(self, data: bytes) -> None:
        with self._lock:
            if self._closed or self._popen is None or self._popen.stdin is None:
                return
            try:
                self._popen.stdin.write(data)
                self._popen.stdin.flush()
            except (OSError, ValueError):
                pass

    def _read(self) -> None:
        assert self._popen is not None and self._popen.stdout is not None
        for raw in self._popen.stdout:
            self._lines.put(raw.decode("utf-8", "replace").rstrip("\r\n"))
        self._eof.set()

    def read(self, wait_s: float = 0.5) -> tuple[list[str], int | None]:
        """The output lines since the last read (waiting up to ``wait_s`` for the first), and the
        exit code once the output has ended and the process exited (128+N: signal N, as
        BOOT reports it). Each call is also the launcher's heartbeat (one byte a second)."""
        now = time.monotonic()
        if now - self._last_beat >= 1.0:
            self._last_beat = now
            self._write(b"\n")
        lines = []
        try:
            lines.append(self._lines.get(timeout=wait_s))
            while len(lines) < MAX_LINES:
                lines.append(self._lines.get_nowait())
        except queue.Empty:
            pass
        code = None
        if self._eof.is_set() and self._lines.empty() and self._popen is not None:
            try:
                code = self._popen.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                code = None
        return lines, code

    def close_stdin(self) -> None:
        """Close the guard's stdin: it stops its group by itself."""
        with self._lock:
            self._closed = True
            if self._popen is not None and self._popen.stdin is not None:
                try:
                    self._popen.stdin.close()
                except OSError:
                    pass

    def signal(self, pgid: int, sig: int) -> None:
        """``sig`` to process group ``pgid`` (the guard's: it leads its own session)."""
        assert isinstance(pgid, int) and pgid > 1
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self, pgid: int) -> bool:
        """Whether a process of group ``pgid`` is alive here (zombies excluded)."""
        import psutil

        for p in psutil.process_iter(["pid", "status"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    return True
            except (ProcessLookupError, psutil.Error):
                continue
        return False
