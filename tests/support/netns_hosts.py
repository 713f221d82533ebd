"""Test hosts for the multi-host tests (not a test module): a generator for a fixture that makes
K network-namespace hosts with scripts/testhosts.py and always removes them, and a check for
processes left inside them.

Use it as::

    @pytest.fixture(scope="module")
    def hosts():
        yield from netns_hosts.make_hosts(2)   # from support import netns_hosts
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support/ -> the checkout
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import testhosts  # noqa: E402

_COUNTER = itertools.count()


def make_hosts(k: int, rate: str | None = None, queue: str = "fifo", shell: str | None = None):
    """Yield a TestHosts of ``k`` hosts with a prefix and subnet unique to this process (so
    parallel test runs do not collide; ``shell="dash"``: commands run under ``dash -c``); skip
    with the reason where they cannot be made; remove everything afterwards, also on failure."""
    reason = testhosts.unavailable()
    if reason:
        pytest.skip(reason)
    n = next(_COUNTER)
    net = 100 + (os.getpid() * 7 + n) % 150
    prefix = f"t{net}x{n % 10}"
    try:
        made = testhosts.up(k, rate=rate, prefix=prefix, net=net, queue=queue, shell=shell)
    except Exception:
        testhosts.down(prefix)
        raise
    # every SSH connection of this process and the `hpar` it starts checks the hosts' keys
    # against the known_hosts file made with them (launcher/procs/ssh.py)
    saved = os.environ.get("HPAR_SSH_KNOWN_HOSTS")
    os.environ["HPAR_SSH_KNOWN_HOSTS"] = made.known_hosts
    try:
        yield made
    finally:
        if saved is None:
            os.environ.pop("HPAR_SSH_KNOWN_HOSTS", None)
        else:
            os.environ["HPAR_SSH_KNOWN_HOSTS"] = saved
        testhosts.down(prefix)


def _is_sshd(pid: int) -> bool:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "sshd"
    except OSError:
        return True  # gone already


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def leftovers(made, wait: float = 0.0) -> dict[str, list[str]]:
    """Namespace -> command lines of live non-sshd processes inside it (should be empty after
    a run); waits up to ``wait`` seconds for them to go."""
    deadline = time.monotonic() + wait
    while True:
        found = {}
        for host in made.hosts:
            pids = [p for p in testhosts.namespace_pids(host.namespace) if _alive(p) and not _is_sshd(p)]
            cmds = []
            for pid in pids:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmds.append(f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace")[:200])
                except OSError:
                    pass
            if cmds:
                found[host.namespace] = cmds
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def host_file(tmp_path, hosts, slots: int = 2, extra: str = "") -> str:
    """A hosts file at ``tmp_path/hosts.txt`` naming every test host with ``slots`` slots (and
    ``extra`` lines after them); returns its path."""
    path = tmp_path / "hosts.txt"
    path.write_text("".join(f"root@{a}:22 slots={slots}\n" for a in hosts.addresses) + extra)
    return str(path)


def real_run(timeout_s: int):
    """Marks of a test that trains over SSH on the network-namespace test hosts: netns,
    multiprocess, slow, and a hard timeout of ``timeout_s`` seconds."""

    def mark(test):
        for m in (pytest.mark.timeout(timeout_s), pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.netns):
            test = m(test)
        return test

    return mark
