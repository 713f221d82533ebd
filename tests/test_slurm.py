"""Slurm: the node-list expansion against ``scontrol show hostnames``, hosts and slots from an
allocation's environment, and ``hpar run`` / ``hpar launch`` inside real allocations of a
Slurm started on this machine (tests/support/slurm_cluster.py; skipped with the reason where it
cannot start)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from support import slurm_cluster
from conftest import REPO, TINY, run_processes, single_process_reference, wait_for, write_script, final_state
from hpar.launcher.hosts.hostfile import Host
from hpar.launcher.hosts.slurm import allocation_hosts, expand_nodelist, expand_tasks_per_node

# (node list, what scontrol 22.05 prints, one name a line)
HARD = [
    ("n[01-03,7],gpu-a[1-2]", "n01 n02 n03 n7 gpu-a1 gpu-a2"),
    ("n[8-10]", "n8 n9 n10"),
    ("n[08-10]", "n08 n09 n10"),
    ("n[1-010]", "n1 n2 n3 n4 n5 n6 n7 n8 n9 n10"),
    ("n[001-3]", "n001 n002 n003"),
    ("rack[1-2]-n[01-02]", "rack1-n01 rack1-n02 rack2-n01 rack2-n02"),
    ("n[1-2]x[3]", "n1x3 n2x3"),
    ("a,b,c", "a b c"),
    ("n[1,1]", "n1 n1"),
    ("n[1-2],,m", "n1 n2 m"),
    ("node-7", "node-7"),
]
BAD = ["x[009-011]y", "n[3-1]", "n[1-3", "n[a-b]", "n]1[", "", "bad_name[1-2]"]


@pytest.mark.parametrize("nodelist,expected", HARD, ids=[h[0] for h in HARD])
def test_expand_nodelist_hard_cases(nodelist, expected):
    assert expand_nodelist(nodelist) == expected.split()


@pytest.mark.parametrize("nodelist", BAD)
def test_expand_nodelist_refuses_what_scontrol_refuses(nodelist):
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(nodelist)


def test_expand_nodelist_matches_scontrol(tmp_path):
    """The same lists through the real ``scontrol show hostnames`` (a minimal config is enough:
    it contacts no daemon)."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol not found (apt-get install -y slurm-wlm)")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=hpartest\nSlurmctldHost=localhost\n")
    env = dict(os.environ, SLURM_CONF=str(conf))
    for nodelist, _ in HARD:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], env=env, capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, out.stderr
        assert expand_nodelist(nodelist) == out.stdout.split(), nodelist
    for nodelist in BAD[:4]:  # scontrol rejects these too (or, for an unclosed '[', prints garbage)
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], env=env, capture_output=True, text=True, timeout=30
        )
        assert out.returncode != 0 or out.stdout.split() != [nodelist], nodelist


def test_tasks_per_node_and_allocation_hosts():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    base = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]"}
    assert allocation_hosts(dict(base, SLURM_TASKS_PER_NODE="2(x2),1")) == [Host("n1", 2), Host("n2", 2), Host("n3", 1)]
    assert allocation_hosts(dict(base, SLURM_NTASKS_PER_NODE="4", SLURM_TASKS_PER_NODE="4(x3)")) == [
        Host(f"n{i}", 4) for i in (1, 2, 3)
    ]
    # GPUs per node win over tasks per node: one worker per GPU
    assert allocation_hosts(dict(base, SLURM_GPUS_ON_NODE="8", SLURM_NTASKS_PER_NODE="1"))[0] == Host("n1", 8)
    assert allocation_hosts(base) == [Host("n1"), Host("n2"), Host("n3")]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        allocation_hosts(dict(base, SLURM_TASKS_PER_NODE="2(x2)"))
    with pytest.raises(ValueError, match="not inside a Slurm allocation"):
        allocation_hosts({"SLURM_JOB_NODELIST": "n1"})


def test_profile_plans_for_the_allocation(monkeypatch):
    """`hpar profile` inside an allocation plans for its hosts and slots (no --hosts)."""
    from hpar.launcher.run.cluster_build import build_cluster

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-04]")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    cluster = build_cluster(None, None, None, "100Gbps", None, None)
    assert cluster.hosts == 4 and list(cluster.gpus_per_host) == [8] * 4 and cluster.workers == 32


# --- a real Slurm on this machine ------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm():
    try:
        cluster = slurm_cluster.start()
    except slurm_cluster.Unavailable as exc:
        pytest.skip(f"no test Slurm: {exc}")
    try:
        yield cluster
    finally:
        slurm_cluster.stop(cluster)


def _no_step_left(slurm, run_dir) -> bool:
    out = slurm.run("squeue", "-h", "-s", "-o", "%i %j", timeout=20)
    return not run_processes(str(run_dir)) and " hpar" not in out.stdout


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpar.launcher.cli", *args]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_run_inside_salloc_matches_one_process(slurm, tmp_path):
    script = write_script(tmp_path)
    run_dir, log = tmp_path / "run", tmp_path / "out.txt"
    with open(log, "w") as out:
        code = subprocess.run(
            [
                "salloc",
                "-N1",
                "-n2",
                *_cli("run", script, "--strategy", "allreduce", "--plain", "--no-eval", "--run-dir", str(run_dir)),
            ],
            env=slurm.env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=200,
            cwd=REPO,
        ).returncode
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "Slurm job" in text and f"hosts {slurm.node}:2; processes start with srun" in text, text[-2000:]
    assert f"[{slurm.node} worker 1] step 20/20" in text
    assert not (run_dir / "srun-tasks.json").exists()  # removed once the step started (issue 61)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["world_size"] == 2
    import torch

    got = final_state(run_dir)
    want = single_process_reference(script, 2, 20, 8, 0.1)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5)
    assert wait_for(lambda: _no_step_left(slurm, run_dir), 10)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_sigkilled_worker_in_salloc_stops_everything(slurm, tmp_path):
    script = write_script(
        tmp_path,
        TINY.replace('"steps": 20', '"steps": 100000').replace(
            "yield x,", "__import__('time').sleep(0.05)\n        yield x,"
        ),
    )
    run_dir, log = tmp_path / "run", tmp_path / "out.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                "salloc",
                "-N1",
                "-n2",
                *_cli(
                    "run",
                    script,
                    "--strategy",
                    "allreduce",
                    "--plain",
                    "--no-eval",
                    "--log-every",
                    "1",
                    "--run-dir",
                    str(run_dir),
                ),
            ],
            env=slurm.env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
    try:
        assert wait_for(lambda: "worker 1] step 3/" in log.read_text(), 120), log.read_text()[-2000:]
        victims = [
            p
            for p in run_processes(str(run_dir))
            if "hpar.workers.worker" in p.cmdline()
            and "hpar.workers.guard" not in p.cmdline()
            and p.environ().get("RANK") == "1"
        ]
        assert len(victims) == 1, victims
        victims[0].kill()
        killed = time.monotonic()
        proc.wait(timeout=60)
        assert proc.returncode == 1, log.read_text()[-3000:]
        assert wait_for(lambda: _no_step_left(slurm, run_dir), 10)
        assert time.monotonic() - killed < 10, "a SIGKILLed worker must stop everything within 10 s"
        assert "worker 1 on" in log.read_text() and "killed by SIGKILL" in log.read_text(), log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_launch_ddp_example_inside_sbatch(slurm, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    batch = tmp_path / "job.sh"
    example = os.path.join(REPO, "examples", "ddp_digits.py")
    batch.write_text(
        "#!/bin/sh\n"
        + " ".join(
            _cli("launch", "--plain", "--env", "HPAR_TEST_MARK=42", "--run-dir", str(run_dir), example, "--epochs", "1")
        )
        + "\n"
    )
    out = slurm.run(
        "sbatch", "--wait", "-N1", "--ntasks-per-node=2", f"--output={log}", f"--chdir={REPO}", str(batch), timeout=200
    )
    text = log.read_text() if log.exists() else ""
    assert out.returncode == 0, out.stdout + out.stderr + text[-3000:]
    assert "processes start with srun" in text and "HPAR_TEST_MARK (--env)" in text, text[-2000:]
    assert f"[{slurm.node} rank 0] epoch 0 validation accuracy" in text, text[-2000:]
    assert "hpar: done: 2 process(es) exited 0" in text
    assert not (run_dir / "srun-tasks.json").exists()  # the --env value reached the tasks in srun's environment
    assert wait_for(lambda: _no_step_left(slurm, run_dir), 10)
