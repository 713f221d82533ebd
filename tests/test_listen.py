"""Where a run listens (issue 61): a run on this machine listens on loopback only (the
rendezvous store and every gloo socket of the launcher and its processes), so another host
cannot reach its store; a multi-host run's store listens on the first host's cluster address
only, whether the launcher holds it (the first host is this machine) or rank 0's guard does (it
is another host); never on the wildcard address torch's own store takes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import psutil
import pytest

from support import netns_hosts
from conftest import REPO, embed_script, run_processes, wait_for, write_script
from hpar.workers.store import loopback_interface

LOOPBACK = ("127.0.0.1", "::1")
WILDCARD = ("0.0.0.0", "::")

# A torchrun-style script that keeps its group up (a barrier every 0.2 s) until the test
# creates the file RELEASE (or 3 minutes pass), printing "step N" as it goes.
HOLD = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
release, step = sys.argv[1], 0
while step < 900:
    flag = torch.tensor([1.0 if os.path.exists(release) else 0.0])
    dist.all_reduce(flag)
    if flag.item() > 0:
        break
    print(f"step {step}", flush=True)
    time.sleep(0.2)
    step += 1
dist.barrier()
dist.destroy_process_group()
"""

# Run inside a network namespace: its listening TCP sockets as JSON [[address, port, pid], ...].
LISTENERS = (
    "import json, psutil; print(json.dumps([[c.laddr.ip, c.laddr.port, c.pid] for c in "
    "psutil.net_connections('tcp') if c.status == psutil.CONN_LISTEN]))"
)
# Run inside a network namespace: argv ADDR PORT...; prints {port: connected} as JSON.
CONNECT = (
    "import json, socket, sys\nout = {}\nfor port in sys.argv[2:]:\n    try:\n"
    "        socket.create_connection((sys.argv[1], int(port)), timeout=3).close(); out[port] = True\n"
    "    except OSError:\n        out[port] = False\nprint(json.dumps(out))"
)


def start(log, *args: str) -> subprocess.Popen:
    """``hpar ARGS`` in the background, stdout and stderr to the file ``log``, stdin closed."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "hpar.launcher.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            start_new_session=True,
        )


def store_address(log) -> tuple[str, int]:
    """The (address, port) the launcher printed: ``hpar: rendezvous at ADDR:PORT (...)``."""
    m = wait_for(lambda: re.search(r"rendezvous at (\S+):([0-9]+) \(", open(log).read()), 60)
    assert m, open(log).read()[-2000:]
    return m.group(1), int(m.group(2))


def run_pids(launcher: subprocess.Popen, run_dir) -> set[int]:
    """The launcher, its descendants and every process of the run (by its HPAR_CONFIG)."""
    pids = {launcher.pid}
    try:
        pids |= {c.pid for c in psutil.Process(launcher.pid).children(recursive=True)}
    except psutil.Error:
        pass
    return pids | {p.pid for p in run_processes(str(run_dir))}


def listeners_here(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket of ``pids`` in this namespace."""
    return [
        (c.laddr.ip, c.laddr.port, c.pid)
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]


def listeners_in(namespace: str) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket in ``namespace`` but sshd's."""
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", LISTENERS],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    found = []
    for ip, port, pid in json.loads(out):
        try:
            if pid is not None and os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "sshd":
                continue
        except OSError:
            continue  # gone
        found.append((ip, port, pid))
    return found


def connects_from(namespace: str, address: str, ports) -> dict[str, bool]:
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", CONNECT, address, *map(str, ports)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return json.loads(out)


def finish(launcher: subprocess.Popen, run_dir, log, timeout: float = 120) -> str:
    """Wait for the launcher (killed after ``timeout`` s); assert that it exited 0 and left no
    process of the run; returns its output."""
    try:
        launcher.wait(timeout=timeout)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, 9)
            launcher.wait()
        text = open(log).read()
        left = wait_for(lambda: not run_processes(str(run_dir)), 10)
        for p in run_processes(str(run_dir)):
            p.kill()
    assert launcher.returncode == 0, text[-3000:]
    assert left, f"processes of the run left behind; output:\n{text[-2000:]}"
    return text


def live_single_host(tmp_path, command: str) -> tuple[subprocess.Popen, str, str, object]:
    """Start ``hpar run`` (hybrid: 2 workers and a parameter server) or ``hpar launch`` (2
    ranks) on this machine; return (launcher, log, run dir, release file) once it trains."""
    run_dir, log, release = tmp_path / "run", str(tmp_path / "out.txt"), tmp_path / "release"
    if command == "run":
        script = write_script(tmp_path, embed_script(steps=80, sleep=0.1))
        launcher = start(
            log, "run", script, "--gpus", "2", "--strategy", "hybrid", "--no-eval", "--plain", "--run-dir", str(run_dir)
        )
        metrics = run_dir / "metrics.jsonl"
        live = lambda: metrics.exists() and metrics.read_text().count('"kind":"metric"') >= 2
    else:
        script = write_script(tmp_path, HOLD, "hold.py")
        launcher = start(log, "launch", "--gpus", "2", "--plain", "--run-dir", str(run_dir), script, str(release))
        live = lambda: "step 2" in open(log).read()
    if not wait_for(live, 150):
        launcher.kill()
        pytest.fail(f"the run never trained:\n{open(log).read()[-3000:]}")
    return launcher, log, run_dir, release


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["run", "launch"])
def test_a_single_host_run_listens_on_loopback_only(tmp_path, command):
    launcher, log, run_dir, release = live_single_host(tmp_path, command)
    try:
        address, port = store_address(log)
        pids = run_pids(launcher, run_dir)
        found = listeners_here(pids)
        workers = [p for p in run_processes(str(run_dir)) if "hpar.workers.guard" not in p.cmdline()]
        interfaces = {p.environ().get("GLOO_SOCKET_IFNAME") for p in workers} | {
            p.environ().get("NCCL_SOCKET_IFNAME") for p in workers
        }
    finally:
        release.write_text("")
    text = finish(launcher, run_dir, log)
    assert len({pid for _, _, pid in found}) >= (4 if command == "run" else 3), found  # every process listens
    assert all(ip in LOOPBACK for ip, _, _ in found), f"listening beyond loopback: {found}"
    assert address == "127.0.0.1" and (address, port, launcher.pid) in found, found  # the launcher holds the store
    assert "listening on 127.0.0.1 only" in text, text[-2000:]
    assert len(workers) >= 2 and interfaces == {loopback_interface()}, interfaces


@pytest.fixture(scope="module")
def one_host():
    yield from netns_hosts.make_hosts(1)


@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.timeout(300)
def test_another_host_cannot_reach_a_single_host_runs_store(one_host, tmp_path):
    """From a network-namespace host on a bridge to this machine, a port this machine listens on
    with the wildcard address is reachable (the control), the run's ports are not."""
    import socket

    control = socket.socket()
    control.bind(("0.0.0.0", 0))
    control.listen()
    control_port = str(control.getsockname()[1])
    launcher, log, run_dir, release = live_single_host(tmp_path, "launch")
    try:
        _, port = store_address(log)
        ports = sorted({p for _, p, _ in listeners_here(run_pids(launcher, run_dir))} | {port})
        reached = connects_from(one_host.hosts[0].namespace, one_host.bridge_address, ports + [control_port])
    finally:
        release.write_text("")
        control.close()
    finish(launcher, run_dir, log)
    assert reached.pop(control_port) is True, "the test host cannot reach this machine at all"
    assert len(reached) >= 3 and not any(reached.values()), reached


@pytest.fixture(scope="module")
def two_hosts():
    yield from netns_hosts.make_hosts(2)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.timeout(300)
@pytest.mark.parametrize("first", ["remote", "local"])
def test_a_multi_host_runs_store_listens_on_the_cluster_address_only(two_hosts, tmp_path, first):
    """``remote``: both ranks on test hosts, rank 0's guard holds the store on the first host's
    address. ``local``: rank 0 here and rank 1 on a test host, the launcher holds the store on
    this machine's address on the bridge. No process of the run listens on a wildcard address."""
    hosts = tmp_path / "hosts.txt"
    lines = [f"root@{a}:22 slots=1" for a in two_hosts.addresses]
    hosts.write_text("\n".join(["localhost slots=1", lines[1]] if first == "local" else lines) + "\n")
    run_dir, log, release = tmp_path / "run", str(tmp_path / "out.txt"), tmp_path / "release"
    script = write_script(tmp_path, HOLD, "hold.py")
    launcher = start(
        log,
        "launch",
        "--hosts",
        str(hosts),
        "--ssh-key",
        two_hosts.key,
        "--plain",
        "--run-dir",
        str(run_dir),
        script,
        str(release),
    )
    try:
        assert wait_for(lambda: "rank 1] step 2" in open(log).read(), 150), open(log).read()[-3000:]
        address, port = store_address(log)
        spaces = [h.namespace for h in two_hosts.hosts][1 if first == "local" else 0 :]
        found = {ns: listeners_in(ns) for ns in spaces}
        here = listeners_here(run_pids(launcher, run_dir))
    finally:
        release.write_text("")
    finish(launcher, run_dir, log)
    if first == "local":
        assert address == two_hosts.bridge_address and (address, port, launcher.pid) in here, (address, here)
    else:
        holder = [(ip, p) for ip, p, _ in found[two_hosts.hosts[0].namespace] if p == port]
        assert address == two_hosts.addresses[0] and holder == [(address, port)], (address, found)
    everything = here + [entry for entries in found.values() for entry in entries]
    assert len(everything) >= 3, everything  # the store and each rank's gloo listener
    assert not [e for e in everything if e[0] in WILDCARD], f"listening on a wildcard address: {everything}"


# --- the pieces, in this process -----------------------------------------------------------------


def own_listeners() -> list[tuple[str, int]]:
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def test_the_launchers_store_listens_on_its_address_only_and_names_the_interface(monkeypatch):
    from hpar.launcher.run.rendezvous import Rendezvous

    monkeypatch.delenv("HPAR_MASTER_PORT", raising=False)
    lo = loopback_interface()
    with Rendezvous("127.0.0.1", True) as rdv:
        assert ("127.0.0.1", rdv.port) in own_listeners() and not [a for a in own_listeners() if a[0] in WILDCARD]
        assert rdv.env == {
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "HPAR_HOLD_STORE": "",
            "GLOO_SOCKET_IFNAME": lo,
            "NCCL_SOCKET_IFNAME": lo,
        }
        assert rdv.describe() == (
            f"rendezvous at 127.0.0.1:{rdv.port} (held by the launcher, listening on "
            f"127.0.0.1 only); gloo and NCCL on {lo}"
        )
    given = {"GLOO_SOCKET_IFNAME": "eth7"}  # --env wins; the line says so
    with Rendezvous("127.0.0.1", True, user_env=given) as rdv:
        assert "GLOO_SOCKET_IFNAME" not in rdv.env and rdv.env["NCCL_SOCKET_IFNAME"] == lo
        assert rdv.describe().endswith(f"; GLOO_SOCKET_IFNAME=eth7 (--env), NCCL_SOCKET_IFNAME={lo}")


def test_with_a_remote_first_host_rank_0s_guard_holds_the_store_on_master_addr(monkeypatch):
    from hpar.launcher.run.rendezvous import Rendezvous
    from hpar.workers.store import guard_store, hold_store

    monkeypatch.delenv("HPAR_MASTER_PORT", raising=False)
    rdv = Rendezvous("10.77.0.2", False)
    assert rdv.env == {"TORCHELASTIC_USE_AGENT_STORE": "True", "HPAR_HOLD_STORE": "1"}  # no loopback here
    assert (
        rdv.describe() == f"rendezvous at 10.77.0.2:{rdv.port} (bound by rank 0's guard, listening on 10.77.0.2 only)"
    )
    env = {"HPAR_HOLD_STORE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(rdv.port)}
    assert (
        guard_store({**env, "RANK": "1"}) is None and guard_store({**env, "HPAR_HOLD_STORE": "", "RANK": "0"}) is None
    )
    assert guard_store({**env, "RANK": "0", "HPAR_PG_RANK": "2"}) is None  # a parameter server of hpar run
    store = guard_store({**env, "RANK": "0"})
    assert store.port == rdv.port and ("127.0.0.1", rdv.port) in own_listeners()
    with pytest.raises(OSError, match=f"rendezvous store at 127.0.0.1:{rdv.port}: .*Address already in use"):
        guard_store({**env, "HPAR_PG_RANK": "0"})  # what the launcher's port_taken() looks for
    with pytest.raises(OSError):
        hold_store("192.0.2.123")  # an address no interface here holds (TEST-NET-1)
    with pytest.raises(AssertionError):
        hold_store("0.0.0.0")
    del store
