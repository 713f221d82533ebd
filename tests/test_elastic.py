"""Elastic restarts over SSH (launcher/run/elastic.py): with --max-restarts and --min-hosts, a
host whose link stays down is left out at the restart and the run resumes from its last
checkpoint on the hosts that answer, at their size (the checkpoint reshards:
strategies/state/state.py); summary.json and the output say so. Real test hosts in network
namespaces (root, iproute2, openssh-server; skipped otherwise)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from support import netns_hosts
from conftest import TINY, write_script
from test_multihost_faults import _start_long_run, _wait_training


@pytest.fixture(scope="module")
def hosts():
    yield from netns_hosts.make_hosts(2)


@netns_hosts.real_run(300)
def test_a_host_that_stays_down_is_left_out_at_the_restart(hosts, tmp_path):
    import testhosts

    script = write_script(
        tmp_path,
        TINY.replace('"steps": 20', '"steps": 40').replace(
            "yield x,", "__import__('time').sleep(0.1)\n        yield x,"
        ),
    )
    proc = _start_long_run(
        hosts,
        tmp_path,
        "--strategy",
        "hybrid",
        "--checkpoint-every",
        "3",
        "--max-restarts",
        "1",
        "--min-hosts",
        "1",
        script=script,
        steps=40,
    )
    try:
        _wait_training(proc, timeout=90)
        latest = tmp_path / "run" / "checkpoints" / "latest"
        deadline = time.monotonic() + 60
        while not (latest.exists() and int(latest.read_text()) >= 6) and time.monotonic() < deadline:
            time.sleep(0.2)
        testhosts.set_link(hosts.prefix, 1, False)  # host 1 is gone for good
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        testhosts.set_link(hosts.prefix, 1, True)
    a, b = hosts.addresses
    assert proc.returncode == 0, out[-3000:]
    assert f"restarting on 1 host(s) with 2 worker(s) (not answering: {b} (" in out, out[-3000:]
    assert f"[{a} worker 1] step 40/40" in out, out[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["elastic"] == [{"restart": 1, "hosts": [a], "lost": [b], "world_size": 2}], summary
    assert summary["world_size"] == 2 and summary["exit_code"] == 0
    assert netns_hosts.leftovers(hosts, wait=15) == {}
