"""Processes on other hosts, over SSH through fabric: ``RemoteProcess`` offers exactly the
methods and attributes of ``LocalProcess`` (launcher/procs/local.py), and ``make_process`` picks one.

The remote command is ``cd CWD && PY -c BOOT PY -m hpar.workers.guard PY -m ...`` with every
piece shlex-quoted, and no environment value in it: sshd hands the command to the login shell
as ``$SHELL -c COMMAND``, which every user of the host sees in ``ps`` (dash keeps it there for
the whole run). The environment (the allowlist of launcher/hosts/environ.py under the spec's
own variables, ``--env`` included) is the first line the launcher writes on the channel's stdin,
as JSON; BOOT reads exactly that line (byte by byte, so nothing after it is consumed), sets it
in ``os.environ`` and acts as ``setsid -w`` (so a signal maps to 128+N as the guard's own exit
codes do). It makes the guard the leader of its own session and process group; the rest of the
channel's stdin stays open and carries one heartbeat byte a second, so
when the launcher's connection goes away the guard stops its group: at EOF (the launcher
exited or was killed) or after ``HEARTBEAT_S`` seconds of silence (a dead link, a frozen
launcher; ``HPAR_GUARD_HEARTBEAT``). Each process is a channel of its host's one connection
(launcher/procs/ssh_pool.py); signals go to the recorded group only, in another channel of it
(launcher/procs/ssh_control.py). TCP keepalives and ``TCP_USER_TIMEOUT`` turn a dead link into
a closed channel within ``LINK_TIMEOUT_S`` s; ``poll()`` then reports ``LOST_HOST`` (255, as ssh).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal as signals
import sys
import threading
import time
from dataclasses import replace

import fabric
import paramiko

from hpar.launcher.hosts.environ import allowlisted
from hpar.launcher.hosts.hostfile import Host
from hpar.launcher.procs import ssh_control, ssh_pool
from hpar.launcher.procs.ssh_connect import LINK_TIMEOUT_S, SSHError, SSHOptions, connect  # noqa: F401 (SSHOptions: hpar's callers import it from here)
from hpar.launcher.procs.local import LocalProcess, ProcessSpec

LOST_HOST = 255
HEARTBEAT_S = 4.0  # the remote guard stops its group after this long without a heartbeat byte
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Read the environment (the first line of stdin, JSON) one byte at a time, leaving the rest for the
# guard; then ``setsid -w`` for our purpose: run argv[1:] as the leader of a new session, wait, and
# exit with its code, or 128+N when it died of signal N (``setsid -w`` itself returns N then).
_BOOT = (
    "import json,os,sys\nline=b''\nwhile not line.endswith(b'\\n'):\n b=os.read(0,1)\n if not b:\n"
    "  sys.exit('hpar: no environment line on stdin (the launcher went away)')\n line+=b\n"
    "os.environ.update(json.loads(line))\npid=os.fork()\nif pid==0:\n os.setsid()\n"
    " os.execvp(sys.argv[1],sys.argv[1:])\n"
    "code=os.waitstatus_to_exitcode(os.waitpid(pid,0)[1])\nsys.exit(128-code if code<0 else code)"
)
CONTROL_TIMEOUT_S = 3.0  # connect (and answer) timeout for a control command (a signal, a check)
DEAD_FOR_S = 30.0  # after a lost connection, control commands skip the host this long
_dead: dict[str, float] = {}
_dead_lock = threading.Lock()


def _mark_dead(host: Host) -> None:
    with _dead_lock:
        _dead[host.name] = time.monotonic()


def _is_dead(host: Host) -> bool:
    with _dead_lock:
        return time.monotonic() - _dead.get(host.name, -DEAD_FOR_S) < DEAD_FOR_S


def started_group(line: str) -> int | None:
    """The process group the guard leads, from its ``@hpar event {"kind": "started", "pgid": N}``
    line; None for any other line (the first lines a remote process prints name its group)."""
    try:
        event = json.loads(line[len("@hpar event ") :])
    except ValueError:
        return None
    if isinstance(event, dict) and event.get("kind") == "started" and isinstance(event.get("pgid"), int):
        return event["pgid"]
    return None


def remote_environment(spec: ProcessSpec) -> dict[str, str]:
    """What the process of ``spec`` gets on its host: the allowlisted part of the launcher's
    environment (launcher/hosts/environ.py) under the spec's own variables (``--env`` included).
    Raises ValueError for a name that is not an identifier."""
    env = allowlisted()  # launcher/hosts/environ.py: the documented allowlist, never everything
    env.update({k: str(v) for k, v in spec.env.items()})
    for key in env:
        if not _ENV_KEY.match(key):
            raise ValueError(f"environment variable name {key!r} of {spec.label} is not an identifier")
    return env


def environment_line(spec: ProcessSpec) -> bytes:
    """The first line the launcher writes on the channel's stdin: :func:`remote_environment`
    as one line of JSON (newlines in values escaped), which BOOT reads and sets."""
    return json.dumps(remote_environment(spec)).encode() + b"\n"


def remote_command(spec: ProcessSpec, python: str | None = None, cwd: str | None = None) -> str:
    """The shell command that runs ``spec`` on a host: ``cd CWD && PY -c BOOT ARGV``, each piece
    shlex-quoted; ``python`` replaces the spec's interpreter (argv[0] and every other
    occurrence of it). It holds no environment: BOOT reads :func:`environment_line` from stdin."""
    argv = list(spec.argv)
    if python:
        argv = [python if a == spec.argv[0] else a for a in argv]
    session = [argv[0], "-c", _BOOT]
    return f"cd {shlex.quote(cwd or os.getcwd())} && " + " ".join(shlex.quote(a) for a in session + argv)


class RemoteProcess:
    """A ProcessSpec running on ``host`` over SSH, with LocalProcess's interface: a reader
    thread puts ``(self, line)`` per output line (stdout and stderr), then ``(self, None)``."""

    def __init__(self, spec: ProcessSpec, host: Host, opts: SSHOptions, lines: "queue.Queue"):
        self.spec = spec
        self.host = host
        self.opts = opts
        self._lines = lines
        self._conn: fabric.Connection | None = None
        self._channel: paramiko.Channel | None = None
        self._done = threading.Event()
        self._code: int | None = None
        self.pid: int | None = None
        self.pgid: int | None = None
        self.host_lost = False  # True once the connection broke (poll() is then LOST_HOST)
        self.ended: dict[int, str] = {}  # what the teardown stopped outside its group (launcher/run/teardown.py)

    def start(self) -> None:
        """Connect and start the process. Raises SSHError when the host cannot be reached."""
        spec = replace(self.spec, env={"HPAR_GUARD_HEARTBEAT": str(HEARTBEAT_S), **self.spec.env})
        command = remote_command(spec, self.opts.python or self.spec.argv[0])
        environment = environment_line(spec)  # over stdin, never in the command (module docstring)
        self._conn = ssh_pool.connection(self.host, self.opts, for_process=True)  # one per host, shared
        try:
            self._channel = self._conn.client.get_transport().open_session()
        except paramiko.ChannelException:  # the host allows fewer sessions per connection (MaxSessions)
            self._conn = connect(self.host, self.opts)
            self._channel = self._conn.client.get_transport().open_session()
        self._channel.set_combine_stderr(True)
        self._channel.exec_command(command)
        try:
            self._channel.sendall(environment)  # first, before any heartbeat byte
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the command ended already: the reader reports its output and code
        threading.Thread(target=self._read, name=f"hpar-ssh-{self.spec.label}", daemon=True).start()
        threading.Thread(target=self._heartbeat, name=f"hpar-beat-{self.spec.label}", daemon=True).start()

    def _heartbeat(self) -> None:
        """One byte a second on the guard's stdin until the process ends or stdin is closed."""
        channel = self._channel
        assert channel is not None
        while not self._done.wait(1.0) and not channel.eof_sent:
            try:
                channel.sendall(b"\n")
            except (OSError, EOFError, paramiko.SSHException):
                return

    def _read(self) -> None:
        assert self._channel is not None
        stream = self._channel.makefile("rb")
        try:
            for raw in stream:
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if self.pgid is None and line.startswith("@hpar event "):
                    self._record(line)
                self._lines.put((self, line))
        except (OSError, EOFError, paramiko.SSHException):
            pass
        channel = self._channel
        # the exit status may follow the EOF; a closed channel sets the event too (code -1)
        channel.status_event.wait(LINK_TIMEOUT_S * 4)
        code = channel.exit_status if channel.status_event.is_set() else -1
        if code >= 0:
            self._code = -(code - 128) if 128 < code < 128 + 65 else code
        else:
            self._code = LOST_HOST
            self.host_lost = True
            _mark_dead(self.host)
            self._lines.put((self, f"[hpar] lost the connection to {self.host.name}"))
        self._done.set()
        self._lines.put((self, None))

    def _record(self, line: str) -> None:
        pgid = started_group(line)
        if pgid is not None:
            self.pid = self.pgid = pgid  # the guard leads its group, as locally

    def poll(self) -> int | None:
        """Exit code once the remote process has ended and its output is read; None while
        running; -N when it (or its guard) died of signal N; LOST_HOST when the connection
        broke."""
        return self._code if self._done.is_set() else None

    def control(self, shell: str, timeout: float = CONTROL_TIMEOUT_S) -> tuple[int, str] | None:
        """Run ``shell`` on the host: (exit code, output), or None if the host is unreachable.
        It is one more channel on the host's open connection (no new handshake), or on a new one
        where that one broke (launcher/procs/ssh_pool.py, ssh_control.py)."""
        if _is_dead(self.host):
            return None  # its guards stop their groups by themselves (no heartbeat)
        try:
            conn = ssh_pool.connection(
                self.host,
                replace(self.opts, retries=0, connect_timeout=min(self.opts.connect_timeout, CONTROL_TIMEOUT_S)),
            )
        except SSHError:
            _mark_dead(self.host)  # skipped from now on (DEAD_FOR_S)
            return None
        return ssh_control.exec_on(conn.client.get_transport(), shell, timeout)

    def _group_command(self, shell: str) -> int | None:
        """:meth:`control`'s exit code (None: unreachable)."""
        return (self.control(shell) or (None,))[0]

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the recorded remote process group (no-op before it is known, after
        the process ended, or when the host is unreachable: its guard then stops the group
        itself when the connection drops)."""
        if self.pgid is None or self._done.is_set():
            return
        assert isinstance(self.pgid, int) and self.pgid > 1
        self._group_command(f"kill -{int(sig)} -- -{self.pgid}")

    def terminate(self) -> None:
        self.signal(signals.SIGTERM)

    def kill(self) -> None:
        self.signal(signals.SIGKILL)

    def group_alive(self) -> bool:
        """True while any process of the recorded group is alive on the host (zombies
        excluded); False when unknown, ended or unreachable."""
        if self.pgid is None:
            return False
        code = self._group_command(f"ps -e -o pgid=,stat= | awk '$1 == {int(self.pgid)} && $2 !~ /^Z/' | grep -q .")
        return code == 0

    def close_stdin(self) -> None:
        """Close the connection: the remote guard sees EOF and stops its group by itself."""
        if self._channel is not None:
            try:
                self._channel.shutdown_write()
            except (OSError, EOFError, paramiko.SSHException):
                pass

    def close(self) -> None:
        """Drop the connection, shared with the host's other processes (their remote groups
        then stop themselves, as when the launcher dies)."""
        if self._conn is not None:
            ssh_pool.forget(self._conn)


def make_process(
    spec: ProcessSpec, hosts_by_name: dict[str, Host], opts: SSHOptions, lines: "queue.Queue"
) -> LocalProcess | RemoteProcess:
    """A LocalProcess for this machine's hosts (unless ``opts.force_ssh``), else a
    RemoteProcess. ``spec.host`` must be a key of ``hosts_by_name`` or "localhost"."""
    host = hosts_by_name.get(spec.host)
    if host is None:
        assert spec.host == "localhost", f"{spec.label}: host {spec.host!r} not in the host list"
        host = Host("localhost")
    ifname = opts.ifnames.get(spec.host)
    if ifname:
        env = {"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname, **spec.env}
        spec = replace(spec, env=env)
    if host.is_local and not opts.force_ssh:
        if opts.python and opts.python != sys.executable:
            argv = tuple(opts.python if a == spec.argv[0] else a for a in spec.argv)
            spec = replace(spec, argv=argv)
        return LocalProcess(spec, lines)
    return RemoteProcess(spec, host, opts, lines)
