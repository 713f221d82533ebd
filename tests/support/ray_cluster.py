"""A real Ray cluster for the Ray tests (not a test module): a head and workers, each ``ray start``
inside its own network namespace (scripts/testhosts.py makes them: distinct addresses on a
bridge), with capped CPUs and a small object store, and everything removed afterwards.

Use it as::

    @pytest.fixture(scope="module")
    def cluster():
        yield from ray_cluster.make_cluster(3)   # from support import ray_cluster

Ray is started with this interpreter (``python -m ray.scripts.scripts start``), so its workers
import the same hpar as the tests. Nothing is stopped by name (``ray stop`` would stop every
Ray on the machine): testhosts' ``down`` kills every process inside the namespaces.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from support import netns_hosts

testhosts = netns_hosts.testhosts
_COUNTER = itertools.count()
CLIENT_PORT = 10001
GCS_PORT = 6379


@dataclass(frozen=True)
class RayCluster:
    """The cluster: its test hosts (``made``; node i is ``made.hosts[i]``, the head is 0)."""

    made: object

    @property
    def head(self):
        return self.made.hosts[0]

    @property
    def gcs(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    @property
    def client(self) -> str:
        return f"ray://{self.head.address}:{CLIENT_PORT}"

    def env(self) -> dict:
        """The environment for a driver on the head node (``--hosts ray``)."""
        return dict(os.environ, RAY_ADDRESS=self.gcs, RAY_USAGE_STATS_ENABLED="0")

    def on_head(self, *argv: str) -> list[str]:
        """``argv`` run inside the head's namespace."""
        return ["ip", "netns", "exec", self.head.namespace, *argv]


def unavailable() -> str | None:
    """Why a Ray cluster cannot be made here (None: it can)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed (pip install 'hpar[ray]')"
    return testhosts.unavailable()


def _start(namespace: str, address: str, head: str | None, log: str) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--node-ip-address",
        address,
        "--num-cpus",
        "2",
        "--object-store-memory",
        "100000000",
        "--disable-usage-stats",
    ]
    argv += (
        ["--address", f"{head}:{GCS_PORT}"]
        if head
        else [
            "--head",
            "--port",
            str(GCS_PORT),
            "--include-dashboard",
            "false",
            "--ray-client-server-port",
            str(CLIENT_PORT),
        ]
    )
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    return subprocess.Popen(
        ["ip", "netns", "exec", namespace, *argv], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env
    )


def make_cluster(k: int = 3):
    """Yield a RayCluster of ``k`` nodes (a head and k-1 workers) in namespaces with a prefix
    unique to this process; skip with the reason where that cannot be done; remove everything
    afterwards, also on failure."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    n = next(_COUNTER)
    net = 100 + (os.getpid() * 11 + n) % 150
    prefix = f"hr{net}x{n % 10}"
    made = None
    try:
        made = testhosts.up(k, prefix=prefix, net=net)
        cluster = RayCluster(made)
        logs = [os.path.join(made.directory, f"ray-{i}.log") for i in range(k)]
        head = _start(made.hosts[0].namespace, made.hosts[0].address, None, logs[0])
        if head.wait(timeout=120) != 0:
            raise RuntimeError(f"ray start --head failed: {open(logs[0]).read()[-2000:]}")
        for h, log in zip(made.hosts[1:], logs[1:]):  # one at a time: nodes started at once race for socket names
            if _start(h.namespace, h.address, made.hosts[0].address, log).wait(timeout=120) != 0:
                raise RuntimeError(f"ray start failed: {open(log).read()[-2000:]}")
        yield cluster  # `ray start` returns once its node is registered: every node is alive
    finally:
        testhosts.down(prefix)


def kill_raylet(cluster: RayCluster, index: int) -> int:
    """SIGKILL the raylet of node ``index`` (found among the processes of its namespace);
    returns its pid."""
    for pid in testhosts.namespace_pids(cluster.made.hosts[index].namespace):
        try:
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            continue
        if exe == "raylet":
            os.kill(pid, 9)
            return pid
    raise AssertionError(f"no raylet in {cluster.made.hosts[index].namespace}")


def run_leftovers(cluster: RayCluster, marker: bytes = b"hpar.workers", wait: float = 0.0) -> dict[str, list[str]]:
    """Namespace -> command lines of live processes whose command line holds ``marker`` (a
    run's guards, workers, servers), on every node; waits up to ``wait`` s for them to go."""
    deadline = time.monotonic() + wait
    while True:
        found = {}
        for host in cluster.made.hosts:
            for pid in testhosts.namespace_pids(host.namespace):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read()
                    with open(f"/proc/{pid}/stat") as f:
                        zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
                except OSError:
                    continue
                if marker in cmd and not zombie:
                    shown = cmd.replace(b"\0", b" ").decode(errors="replace")[:200]
                    found.setdefault(host.namespace, []).append(f"{pid}: {shown}")
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def live_placement_groups(cluster: RayCluster) -> list[str]:
    """Names of the placement groups the cluster has not removed (``ray.util.placement_group_table()``)."""
    code = (
        "import ray, json; ray.init(logging_level='ERROR'); "
        "print(json.dumps([v['name'] for v in ray.util.placement_group_table().values() if v['state'] != 'REMOVED']))"
    )
    out = subprocess.run(
        cluster.on_head(sys.executable, "-c", code), capture_output=True, text=True, env=cluster.env(), timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])
