"""``hpar run --hosts`` over SSH to network-namespace test hosts, with faults that must leave
nothing behind: a remote worker or server SIGKILLed, a link down, the launcher SIGKILLed,
Ctrl-C, restarts, helpers in sessions of their own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import hpar
from support import netns_hosts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LM = os.path.join(ROOT, "examples", "lm.py")


@pytest.fixture(scope="module")
def hosts():
    yield from netns_hosts.make_hosts(2)


def _start_long_run(hosts, tmp_path, *extra: str, script: str = LM, steps: int = 100000) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpar.launcher.cli",
            "run",
            script,
            "--hosts",
            netns_hosts.host_file(tmp_path, hosts),
            "--gpus",
            "4",
            "--steps",
            str(steps),
            "--log-every",
            "1",
            "--ssh-key",
            hosts.key,
            "--plain",
            "--no-eval",
            "--run-dir",
            str(tmp_path / "run"),
            *(extra or ("--strategy", "allreduce")),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_training(proc: subprocess.Popen, timeout: float = 60) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "worker 3] step 2/" in line:
            return lines
    raise AssertionError("training did not start: " + "".join(lines[-20:]))


def _worker_pids(hosts, index: int, module: bytes = b"hpar.workers.worker") -> list[int]:
    """PIDs of the ``python -m module`` processes (not their guards) on test host ``index``."""
    pids = []
    for pid in netns_hosts.testhosts.namespace_pids(hosts.hosts[index].namespace):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if module in cmdline and b"hpar.workers.guard" not in cmdline:
            pids.append(pid)
    return pids


@pytest.fixture
def long_run(hosts, tmp_path):
    proc = _start_long_run(hosts, tmp_path)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        import testhosts

        testhosts.set_link(hosts.prefix, 1, True)


@netns_hosts.real_run(120)
def test_sigkill_of_a_remote_worker_stops_everything(hosts, long_run):
    """Nothing is left on any host within 10 s of a worker's SIGKILL (issue 17; `hpar launch`:
    tests/test_launch.py): the teardown stops each host's groups with one command per host."""
    _wait_training(long_run)
    victims = _worker_pids(hosts, 1)
    assert len(victims) == 2, victims
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as reader:  # the launcher's output, read while the test polls the hosts
        output = reader.submit(long_run.communicate, timeout=60)
        os.kill(victims[0], signal.SIGKILL)
        killed = time.monotonic()
        assert netns_hosts.leftovers(hosts, wait=10) == {}  # polled every 0.2 s
        gone = time.monotonic() - killed
        out = output.result()[0]
    assert long_run.returncode == 1
    assert (
        f"worker 2 on {hosts.addresses[1]} failed: killed by SIGKILL" in out
        or f"worker 3 on {hosts.addresses[1]} failed: killed by SIGKILL" in out
    ), out[-2000:]
    assert gone < 10, f"nothing may be left 10 s after the kill ({gone:.1f} s)"


@netns_hosts.real_run(120)
def test_link_down_mid_run_stops_everything(hosts, long_run):
    import testhosts

    _wait_training(long_run)
    testhosts.set_link(hosts.prefix, 1, False)
    start = time.monotonic()
    out, _ = long_run.communicate(timeout=60)
    stopped = time.monotonic() - start
    testhosts.set_link(hosts.prefix, 1, True)  # the link is back once the launcher is done (issue 18's link cut)
    assert long_run.returncode == 1
    assert f"on {hosts.addresses[1]} failed: lost the connection to its host {hosts.addresses[1]}" in out, out[-2000:]
    # the cut host's guards stop their groups by themselves (no heartbeat from the launcher)
    assert netns_hosts.leftovers(hosts, wait=15) == {}
    gone = time.monotonic() - start
    print(f"link down: launcher stopped after {stopped:.1f} s, nothing left after {gone:.1f} s")
    assert stopped < 10 and gone < 12, "a lost link must stop every process within 10 s"


@netns_hosts.real_run(120)
def test_launcher_sigkilled_leaves_nothing(hosts, long_run):
    _wait_training(long_run)
    os.kill(long_run.pid, signal.SIGKILL)  # the launcher only: its SSH connections drop
    long_run.wait()
    assert netns_hosts.leftovers(hosts, wait=15) == {}


@contextlib.contextmanager
def _long_run(hosts, tmp_path, *extra, **kw):
    """A long ``hpar run`` over the test hosts, once training has started; SIGKILLed (with
    its process group) afterwards if it is still running."""
    proc = _start_long_run(hosts, tmp_path, *extra, **kw)
    try:
        _wait_training(proc, timeout=90)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@netns_hosts.real_run(150)
def test_sigkill_of_a_remote_server_stops_everything(hosts, tmp_path):
    with _long_run(hosts, tmp_path, "--strategy", "hybrid") as proc:
        servers = _worker_pids(hosts, 1, b"hpar.workers.server")
        assert len(servers) == 1, servers
        os.kill(servers[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1
        assert f"server 1 on {hosts.addresses[1]} failed: killed by SIGKILL" in out, out[-2000:]
        assert netns_hosts.leftovers(hosts, wait=10) == {}


@netns_hosts.real_run(150)
def test_ctrl_c_over_ssh_stops_every_host(hosts, tmp_path):
    with _long_run(hosts, tmp_path) as proc:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out[-2000:]
        assert "SIGINT received" in out
        assert netns_hosts.leftovers(hosts, wait=10) == {}


@netns_hosts.real_run(300)
def test_max_restarts_over_ssh_resumes_and_finishes(hosts, tmp_path):
    from conftest import TINY, write_script

    script = write_script(
        tmp_path,
        TINY.replace('"steps": 20', '"steps": 60').replace(
            "yield x,", "__import__('time').sleep(0.1)\n        yield x,"
        ),
    )
    with _long_run(
        hosts,
        tmp_path,
        "--strategy",
        "allreduce",
        "--checkpoint-every",
        "3",
        "--max-restarts",
        "1",
        script=script,
        steps=60,
    ) as proc:
        latest = tmp_path / "run" / "checkpoints" / "latest"
        deadline = time.monotonic() + 60
        while not (latest.exists() and int(latest.read_text()) >= 6) and time.monotonic() < deadline:
            time.sleep(0.2)
        victims = _worker_pids(hosts, 1)
        assert victims, "no worker on the second host"
        os.kill(victims[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=150)
        assert proc.returncode == 0, out[-3000:]
        assert "restart 1/1 from step" in out
        assert "[%s worker 3] step 60/60" % hosts.addresses[1] in out
        assert netns_hosts.leftovers(hosts, wait=10) == {}


@netns_hosts.real_run(200)
def test_helpers_in_sessions_of_their_own_end_with_a_run_over_ssh(hosts, tmp_path):
    """Each remote worker's data() starts a helper in a session of its own that ignores SIGTERM;
    worker 1 then fails. Its guard ends its helper as it exits; worker 0's is ended by the
    teardown on its host (workers/stopgroups.py finds it under the guard before signalling, and
    the guard, told to stop, ends it too); both are named, nothing is left on either host."""
    from conftest import TINY, write_script

    script = write_script(
        tmp_path,
        TINY.replace(
            "def data(rank, world_size, batch_size):",
            """import os, subprocess, sys
def data(rank, world_size, batch_size):
    if os.environ.get("RANK") is not None:
        subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "time.sleep(600)", "hpar-test-helper"], start_new_session=True)
        if os.environ["RANK"] == "1":
            __import__("time").sleep(3)
            raise RuntimeError("worker 1 fails with its helper running")""",
        ),
    )
    out = hpar(
        "run",
        script,
        "--hosts",
        netns_hosts.host_file(tmp_path, hosts, slots=1),
        "--gpus",
        "2",
        "--strategy",
        "allreduce",
        "--ssh-key",
        hosts.key,
        "--plain",
        "--no-eval",
        "--run-dir",
        str(tmp_path / "run"),
        timeout=180,
        cwd=ROOT,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    ended = [line for line in text.splitlines() if line.startswith("hpar: ended ")]
    assert ended and "started by worker 0: " in ended[0] and "started by worker 1: " in ended[0], text[-3000:]
    assert netns_hosts.leftovers(hosts, wait=5) == {}
