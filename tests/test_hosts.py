"""Host list parsing and worker placement (launcher/hosts/hostfile.py): no processes, no network."""

from __future__ import annotations

import os
import socket

import pytest

from hpar.launcher.hosts.hostfile import Host, parse_hosts, place_workers, total_slots, valid_host_name

GOOD_FILES = [
    ("node1 slots=4\nnode2 slots=4\n", [Host("node1", 4), Host("node2", 4)]),
    ("node1:2\nnode2:3\n", [Host("node1", 2), Host("node2", 3)]),
    ("node1\nnode2\n", [Host("node1", 1), Host("node2", 1)]),
    ("# cluster\n\n  node1 slots=2   # big one\n\nnode2\n", [Host("node1", 2), Host("node2", 1)]),
    ("root@node1:2222\n", [Host("node1", 1, "root", 2222)]),
    ("root@node1:2222 slots=8\n", [Host("node1", 8, "root", 2222)]),
    ("node1:22 slots=8\n", [Host("node1", 8, None, 22)]),
    ("node1 slots=2 port=2200 user=alice\n", [Host("node1", 2, "alice", 2200)]),
    ("alice@node1 slots=3\n", [Host("node1", 3, "alice", None)]),
    ("10.0.0.1:4\n10.0.0.2:4\n", [Host("10.0.0.1", 4), Host("10.0.0.2", 4)]),
    ("::1\n", [Host("::1", 1)]),
    ("[fe80::1]:4\n", [Host("fe80::1", 4)]),
    ("[fe80::1]:22 slots=2\n", [Host("fe80::1", 2, None, 22)]),
    ("gpu-node-01.cluster.example.com slots=8\n", [Host("gpu-node-01.cluster.example.com", 8)]),
    ("node1\r\nnode2\r\n", [Host("node1"), Host("node2")]),
    ("node1 port=22\nnode1 port=2222\n", [Host("node1", 1, None, 22), Host("node1", 1, None, 2222)]),
]


@pytest.mark.parametrize("text,expected", GOOD_FILES)
def test_good_host_files(tmp_path, text, expected):
    path = tmp_path / "hosts.txt"
    path.write_text(text)
    assert parse_hosts(str(path)) == expected


BAD_FILES = [
    ("", "lists no hosts"),
    ("# only a comment\n\n", "lists no hosts"),
    ("node1 slots=0\n", "out of range"),
    ("node1 slots=-1\n", "not a whole number"),
    ("node1 slots=two\n", "not a whole number"),
    ("node1:x\n", "not a whole number"),
    ("node1:0\n", "out of range"),
    ("root@node1:70000\n", "out of range"),
    ("node1 gpus=4\n", "unknown option"),
    ("node1 slots=2 slots=3\n", "given twice"),
    ("root@node1 user=bob\n", "user given twice"),
    ("root@node1:22 port=23\n", "port given twice"),
    ("node1\nnode1\n", "duplicate host"),
    ("node1\nNODE1:2\n", "duplicate host"),
    ("node_1\n", "invalid host name"),
    ("-oProxyCommand=touch${IFS}/tmp/x\n", "invalid host name"),
    ("node1;rm -rf /\n", "invalid host name"),
    ("$(touch /tmp/pwned)\n", "invalid host name"),
    ("`touch /tmp/pwned`\n", "invalid host name"),
    ("node1|nc\n", "invalid host name"),
    ("node1&&id\n", "invalid host name"),
    ("'node1'\n", "invalid host name"),
    ("node1>out\n", "invalid host name"),
    ("999.1.1.1\n", "invalid host name"),
    ("-node1\n", "invalid host name"),
    ("node-.example\n", "invalid host name"),
    ("a" * 64 + "\n", "invalid host name"),
    ("$(id)@node1\n", "invalid user name"),
    ("-oProxyCommand=x@node1\n", "invalid user name"),
    ("node1 user=;id\n", "invalid user name"),
    ("[fe80::1\n", "unclosed"),
    ("[fe80::1]x\n", "unexpected"),
    ("fe80::zz\n", "invalid host name"),
    ("node1\x00\n", "control character"),
    ("node1\x1b[31m\n", "control character"),
]


@pytest.mark.parametrize("text,problem", BAD_FILES)
def test_bad_host_files_name_file_line_and_problem(tmp_path, text, problem):
    path = tmp_path / "hosts.txt"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        parse_hosts(str(path))
    message = str(info.value)
    assert problem in message
    assert str(path) in message
    assert "\n" not in message
    if "lists no hosts" not in problem:
        assert f"{path}:" in message  # file:line


def test_error_names_the_right_line(tmp_path):
    path = tmp_path / "h.txt"
    path.write_text("# header\nnode1:2\n\nnode2 slots=abc\n")
    with pytest.raises(ValueError, match=r"h\.txt:4: slot count 'abc'"):
        parse_hosts(str(path))


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        parse_hosts(str(tmp_path / "nope.txt"))
    with pytest.raises(ValueError, match="not found"):
        parse_hosts("missing-hosts.txt")
    binary = tmp_path / "bin.hosts"
    binary.write_bytes(b"\xff\xfe\x00node")
    with pytest.raises(ValueError, match="cannot read"):
        parse_hosts(str(binary))


GOOD_INLINE = [
    ("a:2,b:2", [Host("a", 2), Host("b", 2)]),
    ("a,b,c", [Host("a"), Host("b"), Host("c")]),
    (" a:2 , b ", [Host("a", 2), Host("b")]),
    ("localhost:4", [Host("localhost", 4)]),
    ("root@10.77.0.2:22,root@10.77.0.3:22", [Host("10.77.0.2", 1, "root", 22), Host("10.77.0.3", 1, "root", 22)]),
    ("a slots=3,b", [Host("a", 3), Host("b")]),
    ("2x4", [Host("host0", 4), Host("host1", 4)]),
    ("1x8", [Host("host0", 8)]),
]


@pytest.mark.parametrize("spec,expected", GOOD_INLINE)
def test_good_inline(spec, expected):
    assert parse_hosts(spec) == expected


BAD_INLINE = [
    ("", "empty"),
    ("a:2,,b", "empty item"),
    ("a:2,", "empty item"),
    ("a,a", "duplicate host"),
    ("a;id", "invalid host name"),
    ("a:2,$(reboot)", "invalid host name"),
    ("a b", "unknown option"),
    ("0x4", "at least 1 host"),
    ("2x0", "at least 1 host"),
    ("a:1e3", "not a whole number"),
    ("a\nb", "control character"),
    ("; rm -rf /", "not found"),  # has '/': read as a file name, which does not exist
]


@pytest.mark.parametrize("spec,problem", BAD_INLINE)
def test_bad_inline_names_flag(spec, problem):
    with pytest.raises(ValueError) as info:
        parse_hosts(spec)
    assert problem in str(info.value)
    assert str(info.value).startswith("--hosts")


@pytest.mark.parametrize(
    "name,ok",
    [
        ("node1", True),
        ("a.b.c", True),
        ("fqdn.example.", True),
        ("10.1.2.3", True),
        ("::1", True),
        ("2001:db8::2", True),
        ("1node", True),
        ("", False),
        ("a b", False),
        ("a\tb", False),
        ("-a", False),
        ("a-", False),
        ("a..b", False),
        ("a/b", False),
        ("a$b", False),
        ("a`b`", False),
        ("a\nb", False),
        ("256.0.0.1", False),
        ("1.2.3", False),
        ("x" * 254, False),
        ("[::1]", False),
        ("a*", False),
    ],
)
def test_valid_host_name(name, ok):
    assert valid_host_name(name) is ok


def test_is_local():
    assert Host("localhost").is_local
    assert Host("127.0.0.1").is_local
    assert Host("::1").is_local
    assert Host(socket.gethostname()).is_local
    assert not Host("10.77.0.2").is_local
    assert not Host("node1").is_local


@pytest.mark.parametrize(
    "slots,gpus,expected",
    [
        ([2, 2], 4, ["a", "a", "b", "b"]),
        ([2, 2], 3, ["a", "a", "b"]),
        ([2, 2], 1, ["a"]),
        ([1, 3, 2], 5, ["a", "b", "b", "b", "c"]),
        ([4], 4, ["a"] * 4),
    ],
)
def test_place_workers(slots, gpus, expected):
    hosts = [Host(name, n) for name, n in zip("abc", slots)]
    assert [h.name for h in place_workers(hosts, gpus)] == expected
    assert total_slots(hosts) == sum(slots)


@pytest.mark.parametrize("gpus,problem", [(5, "exceed the 4 slots"), (0, "at least 1"), (-2, "at least 1")])
def test_place_workers_errors_name_gpus(gpus, problem):
    with pytest.raises(ValueError) as info:
        place_workers([Host("a", 2), Host("b", 2)], gpus)
    assert str(info.value).startswith("--gpus")
    assert problem in str(info.value)


def test_cpu_threads_come_from_the_host_that_runs_the_process(monkeypatch):
    """Threads per CPU process (launcher/run/runner.py's thread_env, workers/worker.py's
    cpu_threads): this machine's cores over its hpar processes for local ones; for a remote host
    the count of processes, divided into that host's cores there; the user's --env
    OMP_NUM_THREADS over both (hosts that share one machine's cores, as hpar bench's emulated ones)."""
    from types import SimpleNamespace
    from hpar.launcher.hosts.hostfile import Host
    from hpar.launcher.run.runner import LaunchOptions, thread_env
    from hpar.workers.worker import cpu_threads

    spec = lambda: SimpleNamespace(env={})
    local, remote = Host("localhost", 4), Host("node7", 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    s = spec()
    thread_env(s, local, 3, LaunchOptions())
    assert s.env == {"HPAR_THREADS": str(max(1, (os.cpu_count() or 1) // 3))}
    s = spec()
    thread_env(s, remote, 3, LaunchOptions())
    assert s.env == {"HPAR_PROCS_ON_HOST": "3"}
    s = spec()
    thread_env(s, local, 1, LaunchOptions(slurm=True))  # a Slurm node counts its own cores
    assert s.env == {"HPAR_PROCS_ON_HOST": "1"}
    for host in (local, remote):
        s = spec()
        thread_env(s, host, 3, LaunchOptions(env={"OMP_NUM_THREADS": "5"}))
        assert s.env == {"HPAR_THREADS": "5"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # exported in the launcher's shell: every host, --env wins
    for host, opts, want in (
        (local, LaunchOptions(), "3"),
        (remote, LaunchOptions(), "3"),
        (local, LaunchOptions(slurm=True), "3"),
        (remote, LaunchOptions(env={"OMP_NUM_THREADS": "5"}), "5"),
    ):
        s = spec()
        thread_env(s, host, 2, opts)
        assert s.env == {"HPAR_THREADS": want}
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # empty or not a count: hpar's own choice
    s = spec()
    thread_env(s, remote, 3, LaunchOptions())
    assert s.env == {"HPAR_PROCS_ON_HOST": "3"}
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("HPAR_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("HPAR_PROCS_ON_HOST", "3")
    assert cpu_threads() == 5
    monkeypatch.setenv("HPAR_PROCS_ON_HOST", "40")
    assert cpu_threads() == 1
    monkeypatch.setenv("HPAR_THREADS", "2")
    assert cpu_threads() == 2
