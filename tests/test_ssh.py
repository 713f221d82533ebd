"""launcher/procs/ssh.py: quoting of remote commands, and real SSH round trips to test hosts
(network namespaces with their own sshd; skipped where they cannot be made)."""

from __future__ import annotations

import queue
import shlex
import signal
import subprocess
import sys
import time

import pytest

from support import netns_hosts
from hpar.launcher.hosts.hostfile import Host
from hpar.launcher.procs.local import LocalProcess, ProcessSpec
from hpar.launcher.procs.ssh import (
    LOST_HOST,
    RemoteProcess,
    SSHError,
    SSHOptions,
    connect,
    environment_line,
    make_process,
    remote_command,
)

PY = sys.executable
HOSTILE = ["$(touch {p})", "`touch {p}`", "; touch {p}", "a b\nc", "'\"", "&& touch {p} #", "-oProxyCommand=touch {p}"]


def _spec(code: str, host: str = "h", env: dict | None = None) -> ProcessSpec:
    return ProcessSpec("worker", 0, host, (PY, "-m", "hpar.workers.guard", PY, "-c", code), env or {})


def test_remote_command_quotes_every_value(tmp_path):
    pwned = tmp_path / "pwned"
    values = [h.format(p=pwned) for h in HOSTILE]
    env = {f"V{i}": v for i, v in enumerate(values)}
    code = "import os,sys,json; print(json.dumps([os.environ['V' + str(i)] for i in range(N)] + sys.argv[1:]))".replace(
        "N", str(len(values))
    )
    spec = ProcessSpec("worker", 0, "h", (PY, "-c", code, *values), env)
    weird_dir = tmp_path / "dir with $(touch x) and 'quotes'"
    weird_dir.mkdir()
    command = remote_command(spec, cwd=str(weird_dir))
    out = subprocess.run(
        ["bash", "-c", command], input=environment_line(spec).decode(), capture_output=True, text=True, timeout=30
    )  # the environment goes over stdin, as over SSH
    assert out.returncode == 0, out.stderr
    import json

    assert json.loads(out.stdout.strip().splitlines()[-1]) == values + values
    assert not pwned.exists()
    assert not (weird_dir / "x").exists()


def test_remote_command_replaces_python_and_rejects_bad_env_names():
    spec = _spec("print(1)")
    words = shlex.split(remote_command(spec, python="/opt/py/bin/python3", cwd="/w"))
    assert words[:2] == ["cd", "/w"]
    assert PY not in words and words.count("/opt/py/bin/python3") == 3  # session wrapper, guard, worker
    with pytest.raises(ValueError, match="not an identifier"):
        environment_line(_spec("1", env={"A;touch x": "1"}))


def test_make_process_local_remote_and_forced():
    hosts = {"localhost": Host("localhost", 2), "10.9.9.9": Host("10.9.9.9", 2)}
    q: queue.Queue = queue.Queue()
    assert isinstance(make_process(_spec("1", "localhost"), hosts, SSHOptions(), q), LocalProcess)
    assert isinstance(make_process(_spec("1", "10.9.9.9"), hosts, SSHOptions(), q), RemoteProcess)
    assert isinstance(make_process(_spec("1", "localhost"), hosts, SSHOptions(force_ssh=True), q), RemoteProcess)
    proc = make_process(_spec("1", "10.9.9.9"), hosts, SSHOptions(ifnames={"10.9.9.9": "eth7"}), q)
    assert proc.spec.env["GLOO_SOCKET_IFNAME"] == "eth7" and proc.spec.env["NCCL_SOCKET_IFNAME"] == "eth7"


def test_unreachable_host_is_one_line_error():
    # TEST-NET-1 is never routed; refused quickly or timed out after 1 s
    with pytest.raises(SSHError, match=r"192\.0\.2\.123.*unreachable after 2 attempts"):
        connect(Host("192.0.2.123"), SSHOptions(connect_timeout=1, retries=1))


# --- real SSH to test hosts -------------------------------------------------------------


@pytest.fixture(scope="module")
def hosts():
    yield from netns_hosts.make_hosts(2)


def _drain(q: queue.Queue, timeout: float) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _, line = q.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            return lines
        lines.append(line)
    raise AssertionError(f"no EOF within {timeout} s; got {lines[-5:]}")


def _wait_for(q: queue.Queue, text: str, timeout: float = 20) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, line = q.get(timeout=max(0.01, deadline - time.monotonic()))
        assert line is not None, f"EOF before {text!r}: {lines}"
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} not seen: {lines}")


LOOP = "import os,socket,time\nprint('host', os.environ['RANK'], flush=True)\nwhile True:\n print('tick', flush=True); time.sleep(0.2)"


def _remote(
    hosts, index: int, code: str, env: dict | None = None, key: str | None = None
) -> tuple[RemoteProcess, queue.Queue]:
    q: queue.Queue = queue.Queue()
    address = hosts.addresses[index]
    spec = _spec(code, address, {"RANK": "0", "HPAR_GUARD_GRACE": "1", **(env or {})})
    proc = RemoteProcess(
        spec, Host(address, user="root"), SSHOptions(key=key or hosts.key, connect_timeout=3, retries=0), q
    )
    return proc, q


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_round_trip_lines_group_and_kill(hosts):
    proc, q = _remote(hosts, 1, LOOP, env={"ODD": "$(id) `id` ; x"})
    proc.start()
    try:
        lines = _wait_for(q, "tick")
        assert lines[0].startswith('@hpar event {"kind":"started"')
        assert "host 0" in lines
        assert proc.pgid and proc.pid == proc.pgid and proc.poll() is None
        assert proc.group_alive()
        assert netns_hosts.leftovers(hosts)  # the guard and worker are there
        proc.kill()
        _drain(q, 15)
        assert proc.poll() == -signal.SIGKILL
        assert not proc.group_alive()
        assert netns_hosts.leftovers(hosts, wait=5) == {}
    finally:
        proc.close()


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_exit_code_and_terminate(hosts):
    proc, q = _remote(hosts, 0, "import sys; print('bye', flush=True); sys.exit(3)")
    proc.start()
    assert "bye" in _drain(q, 20)
    assert proc.poll() == 3
    proc.close()
    proc, q = _remote(hosts, 0, LOOP)
    proc.start()
    _wait_for(q, "tick")
    proc.terminate()
    _drain(q, 15)
    assert proc.poll() == -signal.SIGTERM
    proc.close()
    assert netns_hosts.leftovers(hosts, wait=5) == {}


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_dropped_connection_stops_the_remote_group(hosts):
    proc, q = _remote(hosts, 0, LOOP)
    proc.start()
    _wait_for(q, "tick")
    assert netns_hosts.leftovers(hosts)
    proc.close()  # like a launcher that died: the guard sees EOF and stops its group
    assert netns_hosts.leftovers(hosts, wait=10) == {}


def _accepted(hosts, index: int) -> int:
    """Connections the test host's sshd has accepted so far (its log, LogLevel INFO)."""
    import os

    with open(os.path.join(hosts.directory, f"sshd-{index}.log"), errors="replace") as f:
        return sum("Accepted publickey" in line for line in f)


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_teardown_is_one_command_per_host_on_the_open_connection(hosts):
    """Two guarded processes on one host, one ignoring SIGTERM: the teardown stops both with one
    command in a new channel of a connection already open (sshd accepts no new connection), and
    returns once nothing is left there."""
    from hpar.launcher.run import teardown

    stubborn = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + LOOP
    procs = [_remote(hosts, 1, code, env={"HPAR_GUARD_GRACE": "30"}) for code in (LOOP, stubborn)]
    try:
        for proc, q in procs:
            proc.start()
            _wait_for(q, "tick")
        accepted = _accepted(hosts, 1)
        assert accepted >= 1  # the log counts connections (sshd's LogLevel INFO)
        calls = []
        for proc, _ in procs:  # count the control commands each process's connection runs
            proc.control = (lambda real: lambda shell, timeout=3.0: calls.append(shell) or real(shell, timeout))(
                proc.control
            )
        t0 = time.monotonic()
        assert teardown.stop_all([p for p, _ in procs], grace=1.0) == {}
        took = time.monotonic() - t0
        assert len(calls) == 1 and "hpar.workers.stopgroups" in calls[0], calls
        assert netns_hosts.leftovers(hosts) == {}  # at once: the command returned when nothing was left
        assert _accepted(hosts, 1) == accepted
        assert took < 10, took
        for p, q in procs:  # the guards report their end (SIGTERM: the guard leads the group)
            _drain(q, 10)
            assert p.poll() == -signal.SIGTERM
    finally:
        for proc, _ in procs:
            proc.close()


@pytest.mark.netns
@pytest.mark.timeout(30)
def test_wrong_key_is_refused(hosts, tmp_path):
    key = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    with pytest.raises(SSHError, match="authentication failed"):
        connect(Host(hosts.addresses[0], user="root"), SSHOptions(key=str(key), connect_timeout=3))


@pytest.mark.netns
@pytest.mark.timeout(90)
def test_link_down_mid_run_kills_the_remote_process(hosts):
    import testhosts

    proc, q = _remote(hosts, 1, LOOP)
    proc.start()
    try:
        _wait_for(q, "tick")
        testhosts.set_link(hosts.prefix, 1, False)
        start = time.monotonic()
        lines = _drain(q, 40)
        assert proc.poll() == LOST_HOST, lines[-3:]
        assert time.monotonic() - start < 30
        assert any("lost the connection" in line for line in lines)
        # the remote side: sshd notices the dead client (ClientAlive), the guard stops its group
        assert netns_hosts.leftovers(hosts, wait=15) == {}
    finally:
        testhosts.set_link(hosts.prefix, 1, True)
        proc.close()
