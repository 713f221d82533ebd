"""A worker killed mid-run, Ctrl-C, and the launcher itself killed: nothing of the run is left."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import TINY, run_processes, wait_for, write_script

pytestmark = [pytest.mark.multiprocess]

SLOW = TINY.replace('HPAR = {"steps": 20', 'import time\nHPAR = {"steps": 100000').replace(
    "yield x, x.sum(1, keepdim=True)", "time.sleep(0.05)\n        yield x, x.sum(1, keepdim=True)").replace(
    '"log_every": 5', '"log_every": 2')


def start_run(tmp_path, gpus=2):
    script = write_script(tmp_path, SLOW)
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "hpar.launcher.cli", "run", script, "--gpus", str(gpus),
                             "--strategy", "allreduce", "--run-dir", run_dir, "--plain", "--no-eval"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    ok = wait_for(lambda: os.path.exists(metrics) and open(metrics).read().count('"kind":"metric"') >= 2 * gpus, 90)
    assert ok, "the run never made progress"
    return proc, run_dir


def worker_pid(run_dir, rank):
    for p in run_processes(run_dir):
        if "hpar.workers.worker" in p.cmdline()[-1] and p.environ().get("RANK") == str(rank):
            return p.pid
    raise AssertionError(f"no worker {rank} found")


@pytest.mark.timeout(150)
def test_sigkill_worker_stops_everything(tmp_path):
    proc, run_dir = start_run(tmp_path)
    try:
        os.kill(worker_pid(run_dir, 1), signal.SIGKILL)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        assert wait_for(lambda: not run_processes(run_dir), 10), "processes left after the failure"
        assert time.monotonic() - killed < 10 + 3
        assert proc.returncode == 1
        assert "worker 1 on localhost failed: killed by SIGKILL" in out
        assert "last lines of worker-1.log" in out
    finally:
        proc.kill()
        for p in run_processes(run_dir):
            p.kill()


@pytest.mark.timeout(150)
def test_ctrl_c_stops_cleanly(tmp_path):
    proc, run_dir = start_run(tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130
        assert "SIGINT received" in out
        assert not run_processes(run_dir)
        import json
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
        assert summary["exit_code"] == 130
    finally:
        proc.kill()
        for p in run_processes(run_dir):
            p.kill()


@pytest.mark.timeout(150)
def test_launcher_sigkill_leaves_nothing(tmp_path):
    proc, run_dir = start_run(tmp_path)
    try:
        proc.kill()  # SIGKILL: no handler runs; the guards notice their closed stdin
        proc.wait()
        assert wait_for(lambda: not run_processes(run_dir), 10), "workers outlived the launcher"
    finally:
        for p in run_processes(run_dir):
            p.kill()
