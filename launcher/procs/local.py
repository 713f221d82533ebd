"""The processes of a run: what to start (ProcessSpec), and starting, reading and stopping
one on this machine (LocalProcess). Remote processes (launcher/procs/ssh.py) offer the same methods.

Every process runs under ``hpar.workers.guard`` as the leader of its own session, so its
process group holds exactly the guard, the worker and whatever the worker started; signals go
to that recorded group only, never to processes found by name.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import psutil

from hpar.workers.descendants import describe, send


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start. ``role`` is "worker" or "server"; ``rank`` is the worker rank or
    the server index; ``host`` is a host name ("localhost" for this machine); ``env`` holds the
    variables set on top of the launcher's environment (torchrun's and hpar's)."""

    role: str
    rank: int
    host: str
    argv: tuple[str, ...]
    env: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.role} {self.rank}"

    @property
    def log_name(self) -> str:
        return f"{self.role}-{self.rank}.log"


def run_specs(
    world_size: int,
    servers: int,
    config_path: str,
    master_addr: str,
    master_port: int,
    host_of_worker: list[str] | None = None,
    host_of_server: list[str] | None = None,
    python: str | None = None,
    config_sha256: str | None = None,
) -> list[ProcessSpec]:
    """The ProcessSpecs of a run: ``world_size`` workers, then ``servers`` parameter servers.

    Workers get torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    GROUP_RANK = host index, MASTER_ADDR, MASTER_PORT); all processes share one default
    process group of world_size + servers ranks (HPAR_PG_RANK, HPAR_PG_WORLD_SIZE), servers
    after workers. ``host_of_*`` name each process's host (default: all "localhost").
    ``config_sha256`` (HPAR_CONFIG_SHA256): every process refuses a config.json that does not
    hash to it (strategies/job/config.py ``load_config``).
    """
    python = python or sys.executable
    host_of_worker = host_of_worker or ["localhost"] * world_size
    host_of_server = host_of_server or ["localhost"] * servers
    assert len(host_of_worker) == world_size and len(host_of_server) == servers
    hosts = list(dict.fromkeys(host_of_worker + host_of_server))
    common = {
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "HPAR_CONFIG": config_path,
        "HPAR_PG_WORLD_SIZE": str(world_size + servers),
        "HPAR_NUM_SERVERS": str(servers),
        "PYTHONUNBUFFERED": "1",
        **({"HPAR_CONFIG_SHA256": config_sha256} if config_sha256 else {}),
    }
    specs = []
    for rank, host in enumerate(host_of_worker):
        local = [r for r, h in enumerate(host_of_worker) if h == host]
        env = dict(
            common,
            RANK=str(rank),
            LOCAL_RANK=str(local.index(rank)),
            LOCAL_WORLD_SIZE=str(len(local)),
            GROUP_RANK=str(hosts.index(host)),
            HPAR_PG_RANK=str(rank),
        )
        specs.append(
            ProcessSpec(
                "worker", rank, host, (python, "-m", "hpar.workers.guard", python, "-m", "hpar.workers.worker"), env
            )
        )
    for index, host in enumerate(host_of_server):
        env = dict(
            common,
            HPAR_SERVER_INDEX=str(index),
            GROUP_RANK=str(hosts.index(host)),
            HPAR_PG_RANK=str(world_size + index),
            LOCAL_RANK="0",
        )
        specs.append(
            ProcessSpec(
                "server", index, host, (python, "-m", "hpar.workers.guard", python, "-m", "hpar.workers.server"), env
            )
        )
    return specs


class LocalProcess:
    """A ProcessSpec running on this machine, in its own session. A reader thread puts
    ``(self, line)`` for every output line, then ``(self, None)`` at EOF, on ``lines``."""

    def __init__(self, spec: ProcessSpec, lines: "queue.Queue"):
        self.spec = spec
        self._lines = lines
        self._popen: subprocess.Popen | None = None
        self.pid: int | None = None
        self.pgid: int | None = None
        self.host_lost = False  # this machine cannot be lost (RemoteProcess sets it)
        self._escaped: list = []  # psutil.Process of descendants that left the group
        self.ended: dict[int, str] = {}  # pid -> description of each such process stopped with the group

    def start(self) -> None:
        """Start the process (new session, stdin a pipe the guard watches)."""
        env = dict(os.environ, **self.spec.env)
        self._popen = subprocess.Popen(
            self.spec.argv,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
            bufsize=1,
            errors="replace",
        )
        self.pid = self.pgid = self._popen.pid
        threading.Thread(target=self._read, name=f"hpar-read-{self.spec.label}", daemon=True).start()

    def _read(self) -> None:
        assert self._popen is not None and self._popen.stdout is not None
        for line in self._popen.stdout:
            self._lines.put((self, line.rstrip("\n")))
        self._lines.put((self, None))

    def poll(self) -> int | None:
        """Exit code; None while running; -N when it died of signal N."""
        return self._popen.poll() if self._popen else None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process group this launcher started, and to the processes of it
        that moved to a session of their own (no-op once they are gone)."""
        if self.pgid is None:
            return
        escaped = [p for p in self._members() if self._pgid_of(p) != self.pgid]
        if sig in (signal.SIGTERM, signal.SIGKILL):
            for p in escaped:
                self.ended.setdefault(p.pid, describe(p))
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass
        send(escaped, sig)

    @staticmethod
    def _pgid_of(p) -> int | None:
        try:
            return os.getpgid(p.pid)
        except ProcessLookupError:
            return None

    def _members(self) -> list:
        """Live (not zombie) processes of this run's process: its process group, and every
        descendant of its guard even in another session (``start_new_session=True`` in the
        user's code; the guard is their subreaper, workers/guard.py), remembered once seen so
        that they are still reached after the guard is gone."""
        found = {}
        for p in psutil.process_iter(["pid"]):
            if self._pgid_of(p) == self.pgid:
                found[p.pid] = p
        try:
            for c in psutil.Process(self.pid).children(recursive=True):
                found.setdefault(c.pid, c)
        except psutil.Error:
            pass
        for p in self._escaped:
            found.setdefault(p.pid, p)
        alive = []
        for p in found.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                continue
        self._escaped = [p for p in alive if self._pgid_of(p) != self.pgid]
        return alive

    def terminate(self) -> None:
        """SIGTERM, then SIGCONT so that a stopped (SIGSTOP) process acts on it at once."""
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)

    def stopped(self) -> bool:
        """Whether a process of its group is stopped (state T: SIGSTOP, a debugger)."""
        for p in self._members():
            try:
                if p.status() == psutil.STATUS_STOPPED:
                    return True
            except psutil.Error:
                continue
        return False

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def group_alive(self) -> bool:
        """True while any process of its group, or one it started in another session, is alive
        (zombies excluded)."""
        if self.pgid is None:
            return False
        self.poll()  # reap the guard if it exited
        return bool(self._members())

    def close_stdin(self) -> None:
        """Close the guard's watch pipe: it stops its group by itself."""
        if self._popen and self._popen.stdin and not self._popen.stdin.closed:
            try:
                self._popen.stdin.close()
            except OSError:
                pass
