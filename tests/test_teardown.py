"""Teardown per host (launcher/run/teardown.py, workers/stopgroups.py): one command per host
stops every group hpar started there, hosts in parallel, done as soon as nothing is left."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from hpar.launcher.procs.local import ProcessSpec
from hpar.launcher.run import teardown
from hpar.workers import stopgroups

# a process group whose leader ignores SIGTERM (only SIGKILL ends it), with a child in the group
STUBBORN = (
    "import signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print('ready', flush=True)\ntime.sleep(600)"
)
PLAIN = "import time\nprint('ready', flush=True)\ntime.sleep(600)"


def _group(code: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _gone(p: subprocess.Popen) -> bool:
    p.poll()
    return not stopgroups.alive_groups({p.pid})


def test_stop_groups_terms_waits_kills_and_returns_early():
    plain, stubborn, stopped = _group(PLAIN), _group(STUBBORN), _group(PLAIN)
    os.killpg(stopped.pid, signal.SIGSTOP)  # must act on SIGTERM at once (SIGCONT follows it)
    try:
        assert stopgroups.alive_groups({plain.pid, stubborn.pid, stopped.pid}) == {plain.pid, stubborn.pid, stopped.pid}
        t0 = time.monotonic()
        left = stopgroups.stop_groups({plain.pid, stopped.pid}, grace=30, kill_wait=5)
        assert left == set() and time.monotonic() - t0 < 10  # gone on SIGTERM: no wait for the grace
        assert plain.wait(5) == -signal.SIGTERM and stopped.wait(5) == -signal.SIGTERM
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "hpar.workers.stopgroups", "--grace", "0.5", "--kill-wait", "5", str(stubborn.pid)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and out.stdout.strip() == "@hpar left", out
        assert stubborn.wait(5) == -signal.SIGKILL and _gone(stubborn)  # its child too: the whole group
        with pytest.raises(ValueError, match="refusing process group 1"):
            stopgroups.stop_groups({1}, 0, 0)
    finally:
        for p in (plain, stubborn, stopped):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


# a group leader (as a guard is) whose child left for a session of its own and ignores SIGTERM
ESCAPED = (
    "import subprocess, sys, time\n"
    "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print(1, flush=True); time.sleep(600)', 'escaped-helper'], start_new_session=True, stdout=subprocess.PIPE)\n"
    "c.stdout.readline()\nprint('ready', c.pid, flush=True)\ntime.sleep(600)"
)


def test_stop_groups_also_ends_what_left_the_group():
    """workers/stopgroups.py: a process the group's processes started in a session of its own
    is found from the tree before anything is signalled, stopped with the group (SIGKILL after
    the grace, since it ignores SIGTERM) and reported; nothing found by name."""
    leader = subprocess.Popen(
        [sys.executable, "-c", ESCAPED], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    ready, child = leader.stdout.readline().split()
    import psutil

    helper = psutil.Process(int(child))
    try:
        assert ready == "ready" and os.getpgid(helper.pid) != leader.pid
        ended = {}
        t0 = time.monotonic()
        assert stopgroups.stop_groups({leader.pid}, grace=0.5, kill_wait=5, ended=ended) == set()
        assert time.monotonic() - t0 < 5
        helper.wait(5)
        assert not helper.is_running() and leader.wait(5) == -signal.SIGTERM
        assert list(ended) == [leader.pid] and ended[leader.pid][0].startswith(f"{helper.pid} (")
        assert "escaped-helper" in ended[leader.pid][0]
        # over SSH the same report comes back as a line of the host's stop command (launcher/run/teardown.py)
        remote = type("Remote", (), {"pgid": leader.pid, "ended": {}})()
        teardown.record_ended(
            [remote], "@hpar ended " + json.dumps({str(leader.pid): ended[leader.pid]}) + "\n@hpar left"
        )
        assert remote.ended == {helper.pid: ended[leader.pid][0]}
    finally:
        for p in psutil.Process().children(recursive=True):
            p.kill()


class FakeRemote:
    """Stands in for RemoteProcess: ``control`` runs the command in a shell on this machine
    (the real command line: cd, env, the session wrapper, stopgroups), after every host's
    teardown has begun (a barrier: hosts one after another would wait in vain)."""

    calls: list = []

    def __init__(self, host: str, rank: int, group: subprocess.Popen, barrier: threading.Barrier):
        from hpar.launcher.hosts.hostfile import Host
        from hpar.launcher.procs.ssh import SSHOptions

        self.spec = ProcessSpec("worker", rank, host, (sys.executable, "-m", "hpar.workers.guard"))
        self.host, self.opts, self.group, self.barrier = Host(host), SSHOptions(), group, barrier
        self.pid = self.pgid = group.pid

    def control(self, shell: str, timeout: float):
        FakeRemote.calls.append((self.spec.host, shell))
        self.barrier.wait()
        out = subprocess.run(shell, shell=True, capture_output=True, text=True, timeout=timeout)
        return out.returncode, out.stdout + out.stderr


def test_stop_all_sends_one_command_per_host_at_once():
    hosts = [f"10.0.0.{i}" for i in range(2, 6)]
    barrier = threading.Barrier(len(hosts), timeout=20)
    groups = [_group(STUBBORN if i == 0 else PLAIN) for i in range(2 * len(hosts))]
    FakeRemote.calls = []
    procs = [FakeRemote(hosts[i // 2], i, g, barrier) for i, g in enumerate(groups)]
    try:
        t0 = time.monotonic()
        left = teardown.stop_all(procs, grace=1.0)
        took = time.monotonic() - t0
        assert left == {}
        assert sorted(h for h, _ in FakeRemote.calls) == hosts  # one command per host, not per process
        for host, shell in FakeRemote.calls:
            pgids = [str(p.pgid) for p in procs if p.spec.host == host]
            assert shell.endswith(" ".join(sorted(pgids, key=int))), shell
            assert "hpar.workers.stopgroups" in shell and "--grace 1" in shell
        assert all(g.wait(5) in (-signal.SIGTERM, -signal.SIGKILL) for g in groups)
        assert all(_gone(g) for g in groups)
        assert took < 15, took  # the stubborn group's 1 s grace, not one grace per host
    finally:
        for g in groups:
            if g.poll() is None:
                os.killpg(g.pid, signal.SIGKILL)
                g.wait()


def test_stop_host_reports_an_unreachable_host_and_a_failed_command():
    class Unreachable(FakeRemote):
        def control(self, shell, timeout):
            return None

    class Broken(FakeRemote):
        def control(self, shell, timeout):
            return 127, "python: not found"

    group = _group(PLAIN)
    try:
        barrier = threading.Barrier(1)
        assert teardown.stop_host([Unreachable("h", 0, group, barrier)], 1.0, 1.0) == []  # its guards stop it
        assert teardown.stop_host([Broken("h", 3, group, barrier)], 1.0, 1.0) == ["worker 3"]
        assert teardown.stop_all([Broken("h", 3, group, barrier)], 1.0) == {"h": ["worker 3"]}
    finally:
        os.killpg(group.pid, signal.SIGKILL)
        group.wait()


def test_one_ssh_connection_per_host_shared_refilled_and_replaced(monkeypatch):
    """launcher/procs/ssh_pool.py: the preflight, the processes and the teardown of a host share
    one connection (up to 8 processes on it), other hosts connect at the same time (a barrier
    that a pool serialising the hosts would never pass), and a broken one is replaced."""
    from types import SimpleNamespace
    from hpar.launcher.hosts.hostfile import Host
    from hpar.launcher.procs import ssh, ssh_pool

    made = []
    barrier = threading.Barrier(2, timeout=10)

    class Conn:
        def __init__(self, host):
            self.alive = True
            transport = SimpleNamespace(is_active=lambda: self.alive, is_authenticated=lambda: True)
            self.client = SimpleNamespace(get_transport=lambda: transport)
            made.append((host.name, self))
            if len(made) <= 2:
                barrier.wait()  # the first two connections, to two hosts, are made together

        is_connected = property(lambda self: self.alive)

        def close(self):
            self.alive = False

    monkeypatch.setattr(ssh_pool, "connect", lambda host, opts: Conn(host))
    opts = ssh.SSHOptions(key="k")
    a, b = Host("pool-test-a"), Host("pool-test-b")
    first = {}
    threads = [
        threading.Thread(target=lambda h=h: first.setdefault(h.name, ssh_pool.connection(h, opts))) for h in (a, b)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 2 and first["pool-test-a"] is not first["pool-test-b"]
    shared = [ssh_pool.connection(a, opts, for_process=True) for _ in range(ssh_pool.MAX_PROCESSES)]
    assert all(c is first["pool-test-a"] for c in shared) and len(made) == 2
    ninth = ssh_pool.connection(a, opts, for_process=True)  # sshd's MaxSessions: a second connection
    assert ninth is not first["pool-test-a"] and len(made) == 3
    assert ssh_pool.connection(a, opts) is first["pool-test-a"]  # control commands: any open one
    first["pool-test-a"].close()  # broken: the next user gets an open one, or a new one
    assert ssh_pool.connection(a, opts) is ninth
    ssh_pool.forget(ninth)
    assert not ninth.alive and ssh_pool.connection(a, opts) not in (ninth, first["pool-test-a"]) and len(made) == 4


def test_guard_stops_its_group_when_the_heartbeat_stops():
    """A cut link (issue 18): the launcher's heartbeat bytes stop, but the connection is not
    closed (an sshd without ClientAlive keeps the session for hours). The guard stops its group
    by itself after HPAR_GUARD_HEARTBEAT s of silence, a SIGTERM-proof child included."""
    env = dict(os.environ, HPAR_GUARD_HEARTBEAT="1", HPAR_GUARD_GRACE="0.5")
    guard = subprocess.Popen(
        [sys.executable, "-m", "hpar.workers.guard", sys.executable, "-c", STUBBORN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert '"kind":"started"' in guard.stdout.readline()
        assert guard.stdout.readline().strip() == "ready"
        for _ in range(3):  # heartbeats keep it alive
            guard.stdin.write("\n")
            guard.stdin.flush()
            time.sleep(0.5)
        assert guard.poll() is None
        t0 = time.monotonic()  # silence now, with stdin still open
        guard.wait(timeout=30)
        assert time.monotonic() - t0 < 15
        from support.runprocs import wait_for

        assert wait_for(lambda: not stopgroups.alive_groups({guard.pid}), 10)  # the whole group is gone
    finally:
        if guard.poll() is None:
            os.killpg(guard.pid, signal.SIGKILL)
            guard.wait()


def test_guard_told_to_stop_ends_what_left_its_group():
    """A SIGTERM to the guard's group (what srun's scancel and a remote stop send): the worker
    goes with the group; its helper in a session of its own, which ignores SIGTERM, is SIGKILLed
    by the guard after 1 s and named in an ``ended`` event, before the guard itself goes."""
    guard = subprocess.Popen(
        [sys.executable, "-m", "hpar.workers.guard", sys.executable, "-c", ESCAPED],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    import psutil

    try:
        assert '"kind":"started"' in guard.stdout.readline()
        ready, child = guard.stdout.readline().split()
        helper = psutil.Process(int(child))
        os.killpg(guard.pid, signal.SIGTERM)
        helper.wait(10)
        assert guard.wait(10) == -signal.SIGTERM
        assert '"kind": "ended"' in guard.stdout.read() and not helper.is_running()
    finally:
        for p in psutil.Process().children(recursive=True):
            p.kill()


def test_control_command_waits_for_a_free_ssh_session():
    """sshd refuses a channel beyond MaxSessions (10 by default) while the host's processes hold
    theirs: the control command asks again instead of calling the host unreachable."""
    import paramiko
    from types import SimpleNamespace
    from hpar.launcher.procs import ssh_control

    class Channel:
        def __init__(self):
            self.out = [b"@hpar left ", b""]
            self.status_event, self.exit_status = SimpleNamespace(wait=lambda timeout: True), 0

        set_combine_stderr = settimeout = exec_command = close = lambda self, *a: None

        def recv(self, n):
            return self.out.pop(0)

    class Transport:
        def __init__(self, refusals):
            self.refusals = refusals

        def open_session(self, timeout):
            if self.refusals:
                self.refusals -= 1
                raise paramiko.ChannelException(1, "Administratively prohibited")
            return Channel()

    assert ssh_control.exec_on(Transport(3), "true", 5.0) == (0, "@hpar left ")
    t0 = time.monotonic()
    assert ssh_control.exec_on(Transport(10**6), "true", 0.5) is None and time.monotonic() - t0 < 5


def test_a_stall_on_a_cut_off_host_is_named_as_the_lost_host(tmp_path):
    """With --stall-timeout shorter than the SSH link timeout, a cut link first shows as a
    silent process; once the connection is found broken (while the stacks are asked for), the
    failure names the lost host, not a stall."""
    from rich.console import Console
    from hpar.launcher.run.progress import Progress
    from hpar.launcher.run.rundir import RunDir
    from hpar.launcher.run.supervisor import Supervisor

    class Fake:
        def __init__(self, rank, host):
            self.spec = ProcessSpec("worker", rank, host, ("python",))
            self.pid = self.pgid = None
            self.host_lost = False

        def poll(self):
            return 255 if self.host_lost else None

        def signal(self, sig):  # the stack request finds the connection broken
            self.host_lost = self.spec.host == "node2"

        def group_alive(self):
            return False

        terminate = kill = close_stdin = lambda self: None

    procs = [Fake(0, "node1"), Fake(1, "node2")]
    rundir = RunDir(str(tmp_path / "run"))
    with Progress(
        [(p.spec.label, p.spec.host) for p in procs], 10, live=False, console=Console(quiet=True)
    ) as progress:
        sup = Supervisor(procs, queue.Queue(), rundir, progress, stall_timeout=4.0)
        outcome = sup._stall([(id(procs[1]), "stalled: silent for 4 s (--stall-timeout)")])
    rundir.close()
    assert outcome.exit_code == 1 and outcome.failed == "worker 1" and outcome.host == "node2"
    assert outcome.cause.startswith("lost the connection to its host node2"), outcome.cause
