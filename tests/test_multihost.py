"""``hpar run --hosts``: bad input refused before anything starts (exit 2, one line), and real
runs over SSH to network-namespace test hosts (their faults: test_multihost_faults.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support import netns_hosts
from hpar.launcher.hosts.preflight import HostCheck, _row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LM = os.path.join(ROOT, "examples", "lm.py")


def hpar_run(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpar.launcher.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        **kw,
    )


def cli_run(*args: str) -> subprocess.CompletedProcess:
    """``hpar run ARGS`` through the click command in this process (the CLI's own code path,
    without paying for a fresh interpreter and torch import per case)."""
    from click.testing import CliRunner
    from hpar.launcher.cli import main

    result = CliRunner().invoke(main, ["run", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def test_console_script_exits_2_with_one_line(tmp_path):
    (tmp_path / "hosts.txt").write_text("node1;touch PWNED\n")
    out = hpar_run(LM, "--hosts", str(tmp_path / "hosts.txt"), "--gpus", "1", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2
    assert _error_line(out).startswith("hpar: ") and "invalid host name" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists() and not list(tmp_path.rglob("PWNED"))


def _error_line(out: subprocess.CompletedProcess) -> str:
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert lines, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    return lines[-1]


# (name, host file text or None, extra args, expected text in the error line)
BAD = [
    ("bad slot count", "node1 slots=x\n", ["--gpus", "1"], "not a whole number"),
    ("zero slots", "node1 slots=0\n", ["--gpus", "1"], "out of range"),
    ("empty file", "# nothing\n", ["--gpus", "1"], "lists no hosts"),
    ("duplicate host", "node1:2\nnode1:2\n", ["--gpus", "2"], "duplicate host"),
    ("unknown option", "node1 gpus=2\n", ["--gpus", "1"], "unknown option"),
    ("semicolon host", "node1;touch PWNED\n", ["--gpus", "1"], "invalid host name"),
    ("command substitution host", "$(touch PWNED)\n", ["--gpus", "1"], "invalid host name"),
    ("backtick host", "`touch PWNED`\n", ["--gpus", "1"], "invalid host name"),
    ("option injection host", "-oProxyCommand=touch${IFS}PWNED\n", ["--gpus", "1"], "invalid host name"),
    ("hostile user", "$(id)@node1\n", ["--gpus", "1"], "invalid user name"),
    ("port out of range", "root@node1:99999\n", ["--gpus", "1"], "out of range"),
    ("control character", "node1\x1b]0;x\x07\n", ["--gpus", "1"], "control character"),
    ("gpus beyond slots", "node1:2\nnode2:2\n", ["--gpus", "5"], "exceed the 4 slots"),
    ("unknown host", "no-such-host.invalid:2\n", ["--gpus", "2"], "does not resolve"),
    ("inline empty item", None, ["--hosts", "a:2,,b", "--gpus", "1"], "empty item"),
    ("emulated hosts", None, ["--hosts", "emulate:2", "--gpus", "2"], "hpar run needs real hosts: start test hosts"),
    ("inline hostile", None, ["--hosts", "a:2,$(touch PWNED)", "--gpus", "1"], "invalid host name"),
    ("inline newline", None, ["--hosts", "a\nb", "--gpus", "1"], "control character"),
    ("missing host file", None, ["--hosts", "/nonexistent/hosts.txt", "--gpus", "1"], "not found"),
    ("hostile host file path", None, ["--hosts", "/tmp/$(touch PWNED)/h.txt", "--gpus", "1"], "not found"),
    ("missing ssh key", "10.255.255.1:1\n", ["--gpus", "1", "--ssh-key", "/nonexistent/key"], "--ssh-key"),
    ("ssh port out of range", "10.255.255.1:1\n", ["--gpus", "1", "--ssh-port", "70000"], "--ssh-port"),
]


@pytest.mark.parametrize("name,text,args,problem", BAD, ids=[b[0] for b in BAD])
@pytest.mark.timeout(60)
def test_bad_input_is_refused_before_anything_starts(tmp_path, name, text, args, problem):
    run_dir = tmp_path / "run"
    extra = list(args)
    if text is not None:
        (tmp_path / "hosts.txt").write_text(text)
        extra += ["--hosts", str(tmp_path / "hosts.txt")]
    out = cli_run(LM, *extra, "--strategy", "allreduce", "--steps", "1", "--plain", "--run-dir", str(run_dir))
    line = _error_line(out)
    assert out.returncode == 2, (out.returncode, line)
    assert problem in line, line
    assert not run_dir.exists()  # nothing was started
    assert not list(tmp_path.rglob("PWNED")) and not os.path.exists(os.path.join(ROOT, "PWNED"))


@pytest.mark.timeout(60)
def test_hostile_script_path_is_refused(tmp_path):
    script = str(tmp_path / "$(touch PWNED)`id`.py")
    out = cli_run(script, "--hosts", "10.255.255.1:2", "--gpus", "2", "--plain", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert not list(tmp_path.rglob("PWNED")) and not os.path.exists(os.path.join(ROOT, "PWNED"))


def test_preflight_row_names_missing_or_different_script_and_versions():
    want = {"python": "3.11.7", "torch": "2.1", "hpar": "0.1.0", "script": "abc"}
    from hpar.launcher.hosts.hostfile import Host

    base = {"python": "3.11.7", "torch": "2.1", "hpar": "0.1.0", "script": "abc", "ifname": "eth0", "port_free": True}
    assert _row(Host("h"), base, want, "/s.py", 1234, True) == HostCheck(
        "h", True, "", "3.11.7", "2.1", "0.1.0", 0, "eth0"
    )
    for change, text in [
        ({"script": None}, "script /s.py not found"),
        ({"script": "zzz"}, "differs from the launcher's copy"),
        ({"torch": "2.0"}, "torch 2.0 differs"),
        ({"hpar": None}, "hpar not found"),
        ({"port_free": False}, "port 1234 is in use"),
        ({"ifname": None}, "no interface"),
    ]:
        row = _row(Host("h"), {**base, **change}, want, "/s.py", 1234, True)
        assert not row.ok and text in row.problem


# --- over real SSH to test hosts ------------------------------------------------------------


@pytest.fixture(scope="module")
def hosts():
    yield from netns_hosts.make_hosts(2)


NETNS_BAD = [
    ("unreachable port", lambda h: f"root@{h.addresses[0]}:2222 slots=2\n", [], "cannot connect"),
    ("wrong key", None, ["--ssh-key", "WRONGKEY"], "authentication failed"),
    ("missing python", None, ["--python", "/nonexistent/python3"], "python /nonexistent/python3 not found"),
]


@pytest.mark.netns
@pytest.mark.parametrize("name,text,args,problem", NETNS_BAD, ids=[b[0] for b in NETNS_BAD])
@pytest.mark.timeout(90)
def test_bad_hosts_fail_preflight(hosts, tmp_path, name, text, args, problem):
    host_file = netns_hosts.host_file(tmp_path, hosts)
    if text is not None:
        (tmp_path / "hosts.txt").write_text(text(hosts))
    if "WRONGKEY" in args:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "wrong")], check=True)
        args = [str(tmp_path / "wrong") if a == "WRONGKEY" else a for a in args]
    else:
        args = ["--ssh-key", hosts.key, *args]
    out = hpar_run(
        LM,
        "--hosts",
        host_file,
        "--gpus",
        "2",
        "--strategy",
        "allreduce",
        "--steps",
        "1",
        "--plain",
        "--run-dir",
        str(tmp_path / "run"),
        *args,
    )
    line = _error_line(out)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert problem in line, line
    if name != "unreachable port":  # a closed port is refused before profiling (launcher/hosts/reach.py)
        assert "preflight failed" in line and "hpar preflight" in out.stdout + out.stderr, line  # the table
    assert not (tmp_path / "run").exists()
    assert netns_hosts.leftovers(hosts, wait=2) == {}


@pytest.mark.netns
@pytest.mark.timeout(90)
def test_a_host_that_refuses_the_login_is_refused_before_profiling(hosts, tmp_path):
    """--strategy auto profiles the model for a minute on real models: a host whose SSH login
    fails (a key it does not know) is refused by the preflight first, the planner never runs."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "wrong")], check=True)
    out = hpar_run(
        LM,
        "--hosts",
        netns_hosts.host_file(tmp_path, hosts),
        "--gpus",
        "2",
        "--steps",
        "1",
        "--plain",
        "--ssh-key",
        str(tmp_path / "wrong"),
        "--run-dir",
        str(tmp_path / "run"),
    )
    line = _error_line(out)
    assert out.returncode == 2 and "authentication failed" in line and "preflight failed" in line, line
    assert "chose" not in out.stdout and "profil" not in out.stdout.lower(), out.stdout  # no plan, no profile
    assert not (tmp_path / "run").exists()
    assert netns_hosts.leftovers(hosts, wait=2) == {}


@netns_hosts.real_run(120)
def test_run_spreads_workers_over_two_hosts(hosts, tmp_path):
    run_dir = tmp_path / "run"
    out = hpar_run(
        LM,
        "--hosts",
        netns_hosts.host_file(tmp_path, hosts),
        "--gpus",
        "4",
        "--steps",
        "6",
        "--log-every",
        "2",
        "--strategy",
        "hybrid",
        "--ssh-key",
        hosts.key,
        "--plain",
        "--no-eval",
        "--run-dir",
        str(run_dir),
        timeout=110,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    for rank, address in enumerate([hosts.addresses[0]] * 2 + [hosts.addresses[1]] * 2):
        assert f"[{address} worker {rank}] step 6/6" in text, text[-3000:]
    for index, address in enumerate(hosts.addresses):  # one parameter server per host, as in Parallax
        assert f"[{address} server {index}] step 6/6" in text, text[-3000:]
        assert os.path.getsize(run_dir / "logs" / f"server-{index}.log") > 0
    # bytes to the other host: every worker pushes to and pulls from the server there, ranks 1
    # and 3 also send their ring AllReduce bytes across (1 -> 2, 3 -> 0); each server answers
    # two workers on the other host
    import json

    last = {}
    for line in open(run_dir / "metrics.jsonl"):
        m = json.loads(line)
        if m["kind"] == "metric":
            last[(m["role"], m["rank"])] = m
    assert len(last) == 6
    for m in last.values():
        assert 0 < m["bytes_sent_remote"] < m["bytes_sent"], m
    # CPU threads: each host's own cores over the 3 hpar processes placed on it (2 workers, 1 server),
    # counted on that host; the heartbeats in metrics.jsonl say what each process got
    threads = {}
    for line in open(run_dir / "metrics.jsonl"):
        m = json.loads(line)
        if m["kind"] == "heartbeat":
            threads[(m["role"], m["rank"])] = m["threads"]
    assert len(threads) == 6 and set(threads.values()) == {max(1, (os.cpu_count() or 1) // 3)}, threads
    assert "preflight: 2 host(s) ok" in text
    assert netns_hosts.leftovers(hosts, wait=5) == {}
