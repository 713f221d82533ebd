"""``--hosts ray``: hpar's plan placed on a real Ray cluster of 3 nodes (a head and two workers,
each ``ray start`` in its own network namespace: tests/support/ray_cluster.py), through the real
CLI: the cluster read into the planner, hybrid training and a 2-stage pipeline equal to one
process (over Ray Client), a torchrun-style script, the launcher SIGKILLed, and a node's raylet
SIGKILLed mid-run (the run resumes on the two nodes left). One cluster for the module (Ray starts slowly on 2 cores);
the raylet test runs last since it takes a node away."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import final_state, hpar_to_file, single_process_reference, write_script
from support import ray_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECSYS = os.path.join(ROOT, "examples", "recsys.py")
pytestmark = [pytest.mark.multiprocess, pytest.mark.netns]

# A torchrun-style script: joins the group itself, AllReduces its rank, says where it runs;
# with --hold it then waits (for the launcher's SIGKILL)
TORCHRUN = """
import os, socket, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()}/{dist.get_world_size()} sum {t.item():.0f} master {os.environ['MASTER_ADDR']} "
      f"gloo {os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
if "--hold" in sys.argv:
    time.sleep(600)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cluster():
    yield from ray_cluster.make_cluster(3)


def on_head(cluster, out, *args: str, timeout: float = 200) -> tuple[int, str]:
    """``hpar ARGS`` as a driver on the head node (``--hosts ray``, RAY_ADDRESS), output to ``out``."""
    with open(out, "w") as f:
        code = subprocess.run(
            cluster.on_head(sys.executable, "-m", "hpar.launcher.cli", *args),
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            cwd=ROOT,
            env=cluster.env(),
        ).returncode
    return code, open(out).read()


def test_without_ray_hosts_ray_is_one_line(tmp_path):
    fake = tmp_path / "noray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "noray") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-m", "hpar.launcher.cli", "profile", RECSYS, "--hosts", "ray"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == ["hpar: --hosts ray: Ray is not installed here; pip install 'hpar[ray]'"]


def _node(ip, cpus=2.0, gpus=0, alive=True):
    res = {"CPU": cpus, "memory": 8e9, f"node:{ip}": 1.0, **({"GPU": float(gpus)} if gpus else {})}
    return {"Alive": alive, "NodeManagerAddress": ip, "Resources": res, "NodeID": ip.replace(".", "")}


def test_a_refused_client_start_is_retried_and_a_lasting_one_named_in_one_line(monkeypatch):
    """Ray Client's server may fail to start a client's process on a loaded head ("Initialization
    failure from server", seen in CI): connect tries again; a refusal that lasts is one line with
    the server's last line of reason, not its traceback."""
    import types

    from hpar.launcher.hosts import ray_nodes

    calls = []

    def init(address, **_):
        calls.append(address)
        if len(calls) < 3:
            raise ConnectionAbortedError(
                "Initialization failure from server:\nTraceback ...\nRuntimeError: Proxy failed"
            )

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init, shutdown=lambda: None)
    monkeypatch.setattr(ray_nodes, "import_ray", lambda: fake)
    monkeypatch.setattr(ray_nodes.time, "sleep", lambda s: None)
    assert ray_nodes.connect("ray://10.0.0.1:10001") is fake
    assert calls == ["ray://10.0.0.1:10001"] * 3
    calls.clear()
    with pytest.raises(ValueError) as caught:
        ray_nodes.connect("ray://10.0.0.1:10001", attempts=2)
    assert len(calls) == 2
    message = str(caught.value)
    assert "\n" not in message
    assert "(Initialization failure from server: RuntimeError: Proxy failed)" in message


def test_the_node_table_becomes_hosts_and_bundles_pin_processes_to_them():
    """Dead nodes and nodes without CPUs run nothing; a GPU node has a slot per GPU, a CPU node
    one; the launcher's node first, then by address; a rank reserves a GPU (or a CPU), a server
    only its node."""
    from hpar.launcher.hosts.ray_nodes import node_hosts
    from hpar.launcher.procs.local import ProcessSpec
    from hpar.launcher.procs.ray_actor import bundle

    nodes = [
        _node("10.0.0.10"),
        _node("10.0.0.9", gpus=4),
        _node("10.0.0.2", cpus=0),
        _node("10.0.0.3", alive=False),
        _node("10.0.0.11"),
    ]
    hosts = node_hosts(nodes, here="10.0.0.11")
    assert [(h.name, h.slots, h.gpus) for h in hosts] == [("10.0.0.11", 1, 0), ("10.0.0.9", 4, 4), ("10.0.0.10", 1, 0)]
    assert not any(h.is_local for h in hosts)
    rank = ProcessSpec("worker", 0, "10.0.0.9", ("python",))
    server = ProcessSpec("server", 0, "10.0.0.10", ("python",))
    assert bundle(rank, hosts[1]) == {"node:10.0.0.9": 0.001, "GPU": 1.0}
    assert bundle(ProcessSpec("rank", 1, "10.0.0.11", ("python",)), hosts[0]) == {"node:10.0.0.11": 0.001, "CPU": 1.0}
    assert bundle(server, hosts[2]) == {"node:10.0.0.10": 0.001}
    with pytest.raises(ValueError, match="no alive node with CPUs"):
        node_hosts([_node("10.0.0.3", alive=False)])


@pytest.fixture(scope="module")
def profiled(cluster, tmp_path_factory):
    """``hpar profile --hosts ray`` on the head node: (exit code, output, the plan file), the plan
    the runs below start from (so they do not profile again)."""
    where = tmp_path_factory.mktemp("profile")
    code, out = on_head(
        cluster,
        where / "profile.log",
        "profile",
        RECSYS,
        "--hosts",
        "ray",
        "--plan-out",
        str(where / "plan.json"),
        timeout=110,
    )
    return code, out, str(where / "plan.json")


@pytest.mark.timeout(150)
def test_profile_plans_from_the_ray_clusters_nodes(profiled):
    code, out, plan = profiled
    assert code == 0, out[-3000:]
    # one worker per node without GPUs (its CPUs as Ray reports them), a server per node
    assert "Candidates: 3 workers on 3 host(s), 3 server(s)" in out, out[-3000:]
    assert json.load(open(plan))["strategy"] == "hybrid"


@pytest.mark.timeout(200)
def test_hybrid_over_ray_client_equals_one_process(cluster, profiled, tmp_path, reap_run):
    run_dir = tmp_path / "run"
    reap_run(str(run_dir))
    code, out = hpar_to_file(
        tmp_path / "run.log",
        "run",
        RECSYS,
        "--hosts",
        cluster.client,
        "--gpus",
        "3",
        "--plan",
        profiled[2],
        "--steps",
        "4",
        "--batch-size",
        "16",
        "--lr",
        "0.1",
        "--no-eval",
        "--plain",
        "--run-dir",
        str(run_dir),
        timeout=190,
        cwd=ROOT,
    )
    assert code == 0, out[-4000:]
    nodes = cluster.made.addresses
    assert f"rendezvous at {nodes[0]}:" in out  # rank 0's node as Ray reports it, not the driver's
    for index, address in enumerate(nodes):  # a worker and a parameter server on every node
        assert f"[{address} worker {index}] step 4/4" in out, out[-3000:]
        assert f"[{address} server {index}] step 4/4" in out, out[-3000:]
    got = final_state(run_dir)
    want = single_process_reference(RECSYS, 3, 4, 16, 0.1)
    assert got.keys() == want.keys()
    for k in want:  # Adagrad divides by the root of small sums, whose order differs: 1e-5 of 1e-1 rows
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert ray_cluster.run_leftovers(cluster, wait=5) == {}
    assert ray_cluster.live_placement_groups(cluster) == []


@pytest.mark.timeout(150)
def test_launch_runs_a_torchrun_script_and_a_killed_launcher_leaves_nothing(cluster, tmp_path, reap_run):
    script = write_script(tmp_path, TORCHRUN, "train.py")
    reap_run(str(tmp_path / "run"))
    code, out = on_head(
        cluster,
        tmp_path / "launch.log",
        "launch",
        "--hosts",
        "ray",
        "--gpus",
        "3",
        "--plain",
        "--run-dir",
        str(tmp_path / "run"),
        script,
        timeout=120,
    )
    assert code == 0, out[-3000:]
    nodes = cluster.made.addresses
    for rank, address in enumerate(nodes):
        assert f"[{address} rank {rank}] rank {rank}/3 sum 6 master {nodes[0]} gloo eth0" in out, out[-3000:]
    # the launcher SIGKILLed while every rank holds: Ray kills its actors, the guards stop their groups
    log = open(tmp_path / "hold.log", "w")
    proc = subprocess.Popen(
        cluster.on_head(
            sys.executable,
            "-m",
            "hpar.launcher.cli",
            "launch",
            "--hosts",
            "ray",
            "--gpus",
            "3",
            "--plain",
            "--run-dir",
            str(tmp_path / "hold"),
            script,
            "--hold",
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=cluster.env(),
    )
    reap_run(str(tmp_path / "hold"))
    try:
        deadline = time.monotonic() + 90
        while open(tmp_path / "hold.log").read().count(" sum 6 ") < 3:
            assert time.monotonic() < deadline and proc.poll() is None, open(tmp_path / "hold.log").read()[-3000:]
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)  # ip netns exec execs the launcher itself
        proc.wait()
        killed = time.monotonic()
        assert ray_cluster.run_leftovers(cluster, marker=script.encode(), wait=15) == {}
        gone = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    from hpar.launcher.procs.ray_actor import HEARTBEAT_S

    assert gone < HEARTBEAT_S + 5, f"left {gone:.1f} s after the launcher's SIGKILL"


@pytest.mark.timeout(150)
def test_pipeline_stages_on_two_nodes_equal_one_process(cluster, tmp_path, reap_run):
    """A 2-stage 1F1B pipeline over Ray Client: stage 0 on the first node, stage 1 on the second
    (each rank its node's bundle), trained equal to one process on the same batches."""
    script, run_dir = write_script(tmp_path), tmp_path / "run"
    reap_run(str(run_dir))
    code, out = hpar_to_file(
        tmp_path / "run.log",
        "run",
        script,
        "--hosts",
        cluster.client,
        "--gpus",
        "2",
        "--strategy",
        "pipeline",
        "--schedule",
        "1f1b",
        "--micro-batches",
        "2",
        "--steps",
        "4",
        "--no-eval",
        "--plain",
        "--run-dir",
        str(run_dir),
        timeout=140,
        cwd=ROOT,
    )
    assert code == 0, out[-4000:]
    nodes = cluster.made.addresses
    for rank in range(2):  # stage k on node k: the plan's placement held by the bundles
        assert f"[{nodes[rank]} worker {rank}] step 4/4" in out, out[-3000:]
    got, want = final_state(run_dir), single_process_reference(script, 1, 4, 8, 0.1)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert ray_cluster.run_leftovers(cluster, wait=5) == {}
    assert ray_cluster.live_placement_groups(cluster) == []


@pytest.mark.timeout(240)
def test_raylet_sigkilled_mid_run_names_the_node_and_resumes_on_the_rest(cluster, profiled, tmp_path, reap_run):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    reap_run(str(run_dir))
    stall = 20
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cluster.on_head(
                sys.executable,
                "-m",
                "hpar.launcher.cli",
                "run",
                RECSYS,
                "--hosts",
                "ray",
                "--gpus",
                "3",
                "--plan",
                profiled[2],
                "--steps",
                "60",
                "--batch-size",
                "16",
                "--checkpoint-every",
                "20",
                "--log-every",
                "2",
                "--max-restarts",
                "1",
                "--min-hosts",
                "2",
                "--stall-timeout",
                str(stall),
                "--no-eval",
                "--plain",
                "--run-dir",
                str(run_dir),
            ),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=cluster.env(),
        )
    lost = cluster.made.addresses[2]
    try:
        deadline = time.monotonic() + 120
        while max(map(int, re.findall(r"worker 0\] step ([0-9]+)/60", open(log).read())), default=0) < 24:
            assert time.monotonic() < deadline and proc.poll() is None, open(log).read()[-3000:]
            time.sleep(0.3)
        ray_cluster.kill_raylet(cluster, 2)
        killed = time.monotonic()
        while f"failed: lost the connection to its host {lost}" not in open(log).read():
            assert time.monotonic() - killed < stall + 5, open(log).read()[-3000:]
            time.sleep(0.2)
        noticed = time.monotonic() - killed
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = open(log).read()
    assert proc.returncode == 0, out[-4000:]
    assert f"not answering: {lost} (lost during the run)" in out and "restart 1/1 from step" in out, out[-4000:]
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["steps"] == 60 and summary["world_size"] == 2 and summary["elastic"][0]["lost"] == [lost]
    assert ray_cluster.run_leftovers(cluster, wait=10) == {}
    assert ray_cluster.live_placement_groups(cluster) == []
    print(f"raylet SIGKILL: the launcher named the node after {noticed:.1f} s")
