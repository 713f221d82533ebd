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
    """PID of the worker process itself (not of the guard above it)."""
    for p in run_processes(run_dir):
        if p.cmdline()[1:3] == ["-m", "hpar.workers.worker"] and p.environ().get("RANK") == str(rank):
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


HYBRID_SLOW = '''
import time, torch, torch.nn as nn
HPAR = {"steps": 100000, "batch_size": 4, "lr": 0.1, "log_every": 2}
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 4)
        self.out = nn.Linear(4, 1)
    def forward(self, x):
        return self.out(self.emb(x)).squeeze(1)
def model(): return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        time.sleep(0.05)
        yield torch.randint(0, 100, (batch_size,), generator=g), torch.randn(batch_size, generator=g)
def loss(o, t): return ((o - t) ** 2).mean()
'''


@pytest.mark.timeout(150)
def test_sigkill_server_stops_everything(tmp_path):
    script = write_script(tmp_path, HYBRID_SLOW)
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "hpar.launcher.cli", "run", script, "--gpus", "2",
                             "--strategy", "hybrid", "--run-dir", run_dir, "--plain", "--no-eval"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        assert wait_for(lambda: os.path.exists(metrics) and open(metrics).read().count('"kind":"metric"') >= 4, 90)
        server = [p for p in run_processes(run_dir) if p.cmdline()[1:3] == ["-m", "hpar.workers.server"]]
        assert len(server) == 1
        server[0].kill()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 1
        assert "server 0 on localhost failed: killed by SIGKILL" in out
        assert wait_for(lambda: not run_processes(run_dir), 10)
    finally:
        proc.kill()
        for p in run_processes(run_dir):
            p.kill()


@pytest.mark.timeout(200)
def test_max_restarts_resumes_and_finishes(tmp_path):
    from test_allreduce import assert_close_state, single_process_reference
    import json
    import torch
    text = SLOW.replace('"steps": 100000', '"steps": 40')
    script = write_script(tmp_path, text)
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "hpar.launcher.cli", "run", script, "--gpus", "2",
                             "--strategy", "allreduce", "--run-dir", run_dir, "--plain", "--no-eval",
                             "--checkpoint-every", "5", "--max-restarts", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        latest = os.path.join(run_dir, "checkpoints", "latest")
        assert wait_for(lambda: os.path.exists(latest) and int(open(latest).read()) >= 10, 90)
        os.kill(worker_pid(run_dir, 1), signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "worker 1 on localhost failed: killed by SIGKILL" in out
        assert "restart 1/1 from step" in out
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
        assert summary["exit_code"] == 0 and summary["restarts"] == 1
        got = torch.load(os.path.join(run_dir, "model.pt"))
        assert_close_state(got, single_process_reference(script, 2, 40, 8, 0.1, 0))
        assert not run_processes(run_dir)
    finally:
        proc.kill()
        for p in run_processes(run_dir):
            p.kill()
