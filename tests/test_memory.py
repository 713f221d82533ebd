"""Measured peak memory (strategies/memory.py, launcher/run/peaks.py): every worker and
parameter server reports its peak above its baseline, in metrics.jsonl and summary.json."""
import json
import os

import pytest
import torch

from hpar.launcher.run.peaks import PeakFigures
from hpar.strategies import memory

from conftest import hpar_to_file, kill_left, write_script

# 2 x 4 MB of weights per worker, and one 8 MB table the server holds under hybrid
BIG = '''
import torch, torch.nn as nn
HPAR = {"steps": 6, "batch_size": 8, "lr": 0.05, "log_every": 2}
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8192, 256)
        self.a = nn.Linear(256, 1024)
        self.b = nn.Linear(1024, 1024)
        self.out = nn.Linear(1024, 1)
    def forward(self, x):
        return self.out(torch.relu(self.b(torch.relu(self.a(self.emb(x)))))).squeeze(1)
def model(): return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randint(0, 8192, (batch_size,), generator=g), torch.randn(batch_size, generator=g)
def loss(o, t): return ((o - t) ** 2).mean()
def optimizer(params): return torch.optim.SGD(params, lr=0.05, momentum=0.9)
'''
MB = 1 << 20


def test_a_window_measures_what_it_holds_and_survives_a_later_reset():
    """A process window sees a 64 MB tensor made and dropped inside it; a later window's
    reset (a pipeline stage's own) keeps it; a frozen window no longer moves."""
    mem = memory.start_process(torch.device("cpu"))
    try:
        _window(mem)
    finally:
        memory._PROCESS.clear()   # this test process has no window of its own


def _window(mem):
    if mem.base_rss is None:
        pytest.skip("this system cannot reset the resident high-water mark (/proc/self/clear_refs)")
    x = torch.ones(16 * MB)   # 64 MB, touched
    del x
    inner = memory.PeakMemory(torch.device("cpu"))
    inner.start()   # resets the mark: the process window folds its peak first
    peak = memory.process_peak().peak_bytes()
    assert 60 * MB < peak < 200 * MB
    assert inner.peak_bytes() < 32 * MB
    memory.freeze_process()
    y = torch.ones(64 * MB)   # 256 MB after the window closed
    assert memory.process_peak().peak_bytes() == peak
    assert memory.process_peak().figures()["allocated_peak_bytes"] is None   # no CPU allocator view
    del y


def test_peaks_go_to_the_summary_largest_per_role():
    class Spec:
        def __init__(self, role, rank):
            self.role, self.rank, self.host = role, rank, "h"

    class Proc:
        def __init__(self, role, rank):
            self.spec = Spec(role, rank)

    class RunDir:
        rows = []

        def metric(self, row):
            self.rows.append(row)
    rundir = RunDir()
    peaks = PeakFigures(rundir)
    for role, rank, peak in (("worker", 0, 10), ("worker", 1, 30), ("server", 0, 7)):
        peaks.on_event(Proc(role, rank), {"kind": "memory", "peak_bytes": peak, "rss_peak_bytes": peak})
    peaks.on_event(Proc("worker", 0), {"kind": "first_loss", "loss": 1.0})
    out = peaks.apply({"strategy": "hybrid"}, {"memory": {"worker_peak_bytes": 25, "server_peak_bytes": 8}})
    assert out["peak_bytes"] == {"worker": 30, "server": 7}
    assert out["predicted_peak_bytes"] == {"worker": 25, "server": 8}
    assert [(r["role"], r["rank"], r["peak_bytes"]) for r in rundir.rows] == [("worker", 0, 10), ("worker", 1, 30),
                                                                              ("server", 0, 7)]
    assert peaks.apply({}, None)["predicted_peak_bytes"] == {"worker": None, "server": None}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_every_worker_and_server_reports_its_peak(tmp_path):
    """hybrid, 2 workers and a server: each reports its peak once in metrics.jsonl (and in its
    interval metrics); summary.json has the largest per role, and they hold what they must:
    a worker its 4.2 MB of dense weights with their gradients, momentum and DDP's buckets, the
    server its 8.4 MB table and that table's momentum."""
    script = write_script(tmp_path, BIG)
    run_dir = str(tmp_path / "run")
    code, out = hpar_to_file(tmp_path / "out.txt", "run", script, "--gpus", "2", "--strategy", "hybrid",
                             "--run-dir", run_dir, "--no-eval")
    assert not kill_left(run_dir), "processes left behind"
    assert code == 0, out
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    reports = [r for r in rows if r["kind"] == "memory"]
    assert sorted((r["role"], r["rank"]) for r in reports) == [("server", 0), ("worker", 0), ("worker", 1)]
    assert all(r["peak_bytes"] == r["rss_peak_bytes"] for r in reports)   # CPU: the resident figure
    assert all("peak_bytes" in r for r in rows if r["kind"] == "metric" and r["role"] == "worker")
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    dense, table = 4 * (256 * 1024 + 1024 * 1024 + 1024 + 1024 + 1 + 1), 4 * 8192 * 256
    assert summary["peak_bytes"]["worker"] == max(r["peak_bytes"] for r in reports if r["role"] == "worker")
    assert summary["peak_bytes"]["worker"] > 3.5 * dense
    assert summary["peak_bytes"]["server"] > 1.8 * table
