"""Measured peak memory (strategies/common/measured_memory.py, strategies/plan/peaks.py): every worker and
parameter server reports its peak above its baseline, in metrics.jsonl and summary.json."""

import json
import os

import pytest
import torch

from hpar.strategies.plan.peaks import PeakFigures
from hpar.strategies.common import measured_memory as memory
from hpar.strategies.specs.decision import Plan

from conftest import hpar_to_file, kill_left, write_script

# 2 x 4 MB of weights per worker, and one 8 MB table the server holds under hybrid
BIG = """
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
"""
MB = 1 << 20


def test_a_window_measures_what_it_holds_and_survives_a_later_reset():
    """A process window sees a 64 MB tensor made and dropped inside it; a later window's
    reset (a pipeline stage's own) keeps it; a frozen window no longer moves."""
    mem = memory.start_process(torch.device("cpu"))
    try:
        _window(mem)
    finally:
        memory._PROCESS.clear()  # this test process has no window of its own


def _window(mem):
    if mem.base_rss is None:
        pytest.skip("this system cannot reset the resident high-water mark (/proc/self/clear_refs)")
    x = torch.ones(16 * MB)  # 64 MB, touched
    del x
    inner = memory.PeakMemory(torch.device("cpu"))
    inner.start()  # resets the mark: the process window folds its peak first
    peak = memory.process_peak().peak_bytes()
    assert 60 * MB < peak < 200 * MB
    assert inner.peak_bytes() < 32 * MB
    memory.freeze_process()
    y = torch.ones(64 * MB)  # 256 MB after the window closed
    assert memory.process_peak().peak_bytes() == peak
    assert memory.process_peak().figures()["allocated_peak_bytes"] is None  # no CPU allocator view
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
    out = peaks.apply({"strategy": "hybrid"}, Plan(memory={"worker_peak_bytes": 25, "server_peak_bytes": 8}))
    assert out["peak_bytes"] == {"worker": 30, "server": 7}
    assert out["predicted_peak_bytes"] == {"worker": 25, "server": 8}
    assert [(r["role"], r["rank"], r["peak_bytes"]) for r in rundir.rows] == [
        ("worker", 0, 10),
        ("worker", 1, 30),
        ("server", 0, 7),
    ]
    assert peaks.apply({}, None)["predicted_peak_bytes"] == {"worker": None, "server": None}


FRAGMENTS = """
import random, torch
from hpar.strategies.common import measured_memory as memory
memory.limit_retention()   # as every measuring process
rng = random.Random(0)
keep, junk = [], []
for i in range(3000):   # 8-480 KB blocks, under the mmap threshold: from glibc's heap
    (keep if i % 10 == 0 else junk).append(torch.ones(rng.randint(2_000, 120_000)))
del junk   # freed, but scattered between the kept ones: the heap's top cannot be cut
live = sum(t.numel() * 4 for t in keep)
before = memory.status_bytes("VmRSS")
memory.release_freed_memory_paced()
after = memory.status_bytes("VmRSS")
print(live, before, after)
"""


def test_paced_trim_returns_scattered_freed_blocks():
    """Blocks under the mmap threshold freed between live ones stay resident until
    malloc_trim; the step-end trim returns them (a worker whose sparse rows change size every
    step: examples/lm.py's hybrid workers held 25 MB of them after 200 steps)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FRAGMENTS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    live, before, after = map(int, done.stdout.split())
    assert before - after > 4 * live  # ~600 MB freed around ~70 MB live


def test_trimming_takes_at_most_its_share_of_the_time(monkeypatch):
    """release_freed_memory_paced trims, then not again until its last trim's duration /
    TRIM_TIME_SHARE has passed."""
    clock, calls = [100.0], []

    def trim():
        calls.append(clock[0])
        clock[0] += 0.002  # a trim of 2 ms

    monkeypatch.setattr(memory, "release_freed_memory", trim)
    monkeypatch.setattr(memory.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(memory, "_NEXT_TRIM", [0.0])
    for _ in range(400):  # steps of 1 ms
        memory.release_freed_memory_paced()
        clock[0] += 0.001
    assert calls[0] == 100.0 and len(calls) >= 2
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert min(gaps) >= 0.002 / memory.TRIM_TIME_SHARE - 1e-9  # 0.2 s between trims of 2 ms
    assert 0.002 * len(calls) <= memory.TRIM_TIME_SHARE * (clock[0] - 100.0) + 0.002


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_every_worker_and_server_reports_its_peak(tmp_path):
    """hybrid, 2 workers and a server: each reports its peak once in metrics.jsonl (and in its
    interval metrics); summary.json has the largest per role, and they hold what they must:
    a worker its 4.2 MB of dense weights with their gradients, momentum and DDP's buckets, the
    server its 8.4 MB table and that table's momentum."""
    script = write_script(tmp_path, BIG)
    run_dir = str(tmp_path / "run")
    code, out = hpar_to_file(
        tmp_path / "out.txt", "run", script, "--gpus", "2", "--strategy", "hybrid", "--run-dir", run_dir, "--no-eval"
    )
    assert not kill_left(run_dir), "processes left behind"
    assert code == 0, out
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    reports = [r for r in rows if r["kind"] == "memory"]
    assert sorted((r["role"], r["rank"]) for r in reports) == [("server", 0), ("worker", 0), ("worker", 1)]
    assert all(r["peak_bytes"] == r["rss_peak_bytes"] for r in reports)  # CPU: the resident figure
    assert all(r["trims"] >= 1 for r in reports)  # each handed freed heap blocks back at a step's end
    assert all("peak_bytes" in r for r in rows if r["kind"] == "metric" and r["role"] == "worker")
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    dense, table = 4 * (256 * 1024 + 1024 * 1024 + 1024 + 1024 + 1 + 1), 4 * 8192 * 256
    assert summary["peak_bytes"]["worker"] == max(r["peak_bytes"] for r in reports if r["role"] == "worker")
    assert summary["peak_bytes"]["worker"] > 3.5 * dense
    assert summary["peak_bytes"]["server"] > 1.8 * table


# BIG whose evaluate() holds 200 MB for a moment: evaluation, not training
BIG_EVAL = (
    BIG
    + """
def evaluate(model):
    scratch = torch.ones(50_000_000)
    return {"scratch": float(scratch[0])}
"""
)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["allreduce", "hybrid"])
def test_the_first_evaluate_is_not_training_memory(tmp_path, strategy):
    """Worker 0 evaluates before training by default (hybrid and ps inside their runtime, which
    needs the servers): evaluate()'s own peak stays out of the measured training peak, which the
    memory model predicts, under every strategy alike."""
    script = write_script(tmp_path, BIG_EVAL)
    run_dir = str(tmp_path / "run")
    code, out = hpar_to_file(
        tmp_path / "out.txt", "run", script, "--gpus", "1", "--strategy", strategy, "--steps", "4", "--run-dir", run_dir
    )
    assert not kill_left(run_dir), "processes left behind"
    assert code == 0, out
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["eval_first"] == {"scratch": 1.0}
    assert 0 < summary["peak_bytes"]["worker"] < 120 * MB  # training: under 40 MB; evaluate(): 200 MB more


WIDE = """
import torch, torch.nn as nn
HPAR = {"steps": 6, "batch_size": 16, "lr": 0.01, "log_every": 3}
def model():
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        x = torch.randn(batch_size, 1024, generator=g)
        yield x, x
def loss(o, t): return ((o - t) ** 2).mean()
def optimizer(params): return torch.optim.SGD(params, lr=0.01, momentum=0.9)
"""


def _profile_json(tmp_path, script, *args):
    code, out = hpar_to_file(
        tmp_path / "profile.out", "profile", script, "--gpus", "2", "--bandwidth", "1Gbps", "--json", *args
    )
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_profile_predicts_every_candidates_peaks_and_plans_what_fits(tmp_path):
    """hpar profile --json gives every candidate's predicted peak per worker (per server for
    hybrid/ps) and whether it fits; with --worker-memory between the pipeline's need and
    allreduce's, allreduce is not runnable for its memory, with the one reason, and the plan
    takes a strategy that fits, saying why."""
    script = write_script(tmp_path, WIDE)
    free = _profile_json(tmp_path, script)
    cands = {c["strategy"]: c for c in free["candidates"]}
    # (TorchRec's rows on a model without a table are not predicted: tests/test_torchrec_costmodel.py)
    cands = {s: c for s, c in cands.items() if not s.startswith("torchrec")}
    assert all(c["memory"]["worker_peak_bytes"] > 0 for c in cands.values())
    assert cands["ps"]["memory"]["server_peak_bytes"] > 0 and cands["allreduce"]["memory"]["server_peak_bytes"] is None
    need = lambda c: c["memory"]["worker_peak_bytes"] + c["memory"]["overhead_bytes"]
    weights = 6 * 4 * (1024 * 1024 + 1024)
    assert cands["allreduce"]["memory"]["worker_terms"]["params"] == weights
    assert need(cands["allreduce"]) - need(cands["pipeline"]) > weights  # buckets, and the stage's half
    cap = round((need(cands["allreduce"]) + need(cands["pipeline"])) / 2 / 1e9, 4)  # as the flag gives it
    tight = _profile_json(tmp_path, script, "--worker-memory", f"{cap:.4f}")
    cands = {c["strategy"]: c for c in tight["candidates"]}
    assert not cands["allreduce"]["available"] and cands["allreduce"]["memory"]["fits"] is False
    assert (
        cands["allreduce"]["note"]
        == f"needs {need(cands['allreduce']) / 1e9:.3g} GB per worker, {cap:.3g} GB available"
    )
    assert cands["pipeline"]["memory"]["fits"] is True
    assert tight["plan"]["strategy"] in ("pipeline", "ps") and tight["cluster"]["worker_memory_bytes"] == pytest.approx(
        cap * 1e9, rel=1e-3
    )
    assert tight["plan"]["memory"]["fits"] is True


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_run_refuses_a_strategy_that_does_not_fit_unless_forced(tmp_path):
    """--strategy allreduce with a --worker-memory below its predicted need: one line, exit 2,
    no process; with --force it runs, and summary.json has the prediction beside the peaks."""
    script = write_script(tmp_path, WIDE)
    run_dir = str(tmp_path / "run")
    code, out = hpar_to_file(
        tmp_path / "refused.out",
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "allreduce",
        "--worker-memory",
        "0.05",
        "--run-dir",
        run_dir,
    )
    assert code == 2, out
    refusal = [line for line in out.splitlines() if "GB per worker" in line]
    assert len(refusal) == 1 and refusal[0].startswith("hpar: --strategy allreduce needs ")
    assert refusal[0].endswith(
        "0.05 GB available (--worker-memory); choose a strategy that fits (hpar profile "
        "lists them), or --force to run it anyway"
    )
    assert not os.path.exists(os.path.join(run_dir, "config.json"))
    code, out = hpar_to_file(
        tmp_path / "forced.out",
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "allreduce",
        "--worker-memory",
        "0.05",
        "--force",
        "--run-dir",
        run_dir,
        "--no-eval",
    )
    assert not kill_left(run_dir), "processes left behind"
    assert code == 0, out
    assert "running it anyway (--force)" in out
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    predicted, measured = summary["predicted_peak_bytes"]["worker"], summary["peak_bytes"]["worker"]
    assert predicted > 4 * 6 * 4 * 1024 * 1024 and measured > 0 and summary["predicted_peak_bytes"]["server"] is None


WIDE_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "wide.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_model_too_large_for_allreduce_is_planned_onto_what_fits_and_runs_within_it(tmp_path):
    """examples/wide.py (134 MB of weights, SGD with momentum): planned for 8 GPUs with a
    --worker-memory below what its allreduce replica needs, the plan is pipeline or fsdp and says
    that allreduce does not fit; at the scale this machine runs (2 CPU workers), hpar run --strategy
    auto with a --worker-memory that allreduce exceeds chooses a plan predicted to fit, and no worker's
    resident memory (its baseline plus its measured peak, in training and through the final write)
    exceeds the stated memory."""
    projected = _profile_json(
        tmp_path, WIDE_EXAMPLE, "--gpus", "8", "--hosts", "2x4", "--device-tflops", "50", "--worker-memory", "0.3"
    )
    assert projected["cluster"]["workers"] == 8
    cands = {c["strategy"]: c for c in projected["candidates"]}
    assert cands["allreduce"]["memory"]["fits"] is False and cands["allreduce"]["note"].startswith("needs ")
    assert projected["plan"]["strategy"] in ("pipeline", "fsdp")
    fits = [s for s in ("pipeline", "fsdp") if cands[s]["available"]]
    assert projected["plan"]["strategy"] == max(fits, key=lambda s: cands[s]["samples_per_s"])
    assert f"Does not fit the memory: allreduce {cands['allreduce']['note']}" in projected["plan"]["reason"]
    here = _profile_json(tmp_path, WIDE_EXAMPLE)  # 2 CPU workers
    need = {
        c["strategy"]: c["memory"]["worker_peak_bytes"] + c["memory"]["overhead_bytes"]
        for c in here["candidates"]
        if not c["strategy"].startswith("torchrec")  # no table in wide.py: TorchRec's rows not predicted
    }
    cap = (need["allreduce"] + max(need["pipeline"], need["fsdp"])) / 2 / 1e9
    run_dir = str(tmp_path / "run")
    code, out = hpar_to_file(
        tmp_path / "run.out",
        "run",
        WIDE_EXAMPLE,
        "--gpus",
        "2",
        "--steps",
        "4",
        "--no-eval",
        "--worker-memory",
        f"{cap:.3f}",
        "--run-dir",
        run_dir,
        timeout=500,
    )
    assert not kill_left(run_dir), "processes left behind"
    assert code == 0, out
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    # a plan whose workers hold less than a replica and its optimizer state: pipeline, fsdp, or
    # ps (its servers hold the weights and their momentum), whichever is predicted fastest
    assert summary["strategy"] != "allreduce" and need[summary["strategy"]] <= cap * 1e9, out
    assert "Does not fit the memory: allreduce needs" in out
    reports = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    workers = [r for r in reports if r["kind"] == "memory" and r["role"] == "worker"]
    assert len(workers) == 2 and all(r["baseline_bytes"] + r["peak_bytes"] <= cap * 1e9 for r in workers), (
        cap,
        [(r["baseline_bytes"], r["peak_bytes"]) for r in workers],
    )
    # and through the final write (measured apart from training: final_peak_bytes)
    assert all(r["baseline_bytes"] + r["final_peak_bytes"] <= cap * 1e9 for r in workers), (
        cap,
        [(r["baseline_bytes"], r["final_peak_bytes"]) for r in workers],
    )


# A 100 MB table and a small dense part; EVALUATE appends an evaluate() that reads nothing
TABLE = """
import torch, torch.nn as nn
HPAR = {"steps": 2, "batch_size": 16, "lr": 0.1, "log_every": 1}
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50_000, 512)
        self.head = nn.Linear(512, 1)
    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))
def model(): return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randint(0, 50_000, (batch_size, 4), generator=g), torch.randn(batch_size, 1, generator=g)
def loss(o, t): return ((o - t) ** 2).mean()
"""
EVALUATE = "\ndef evaluate(model):\n    return {}\n"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,evaluate", [("hybrid", False), ("hybrid", True), ("fsdp", False)])
def test_a_whole_copy_after_training_only_for_evaluate(tmp_path, strategy, evaluate):
    """After the last step (the final write, measured apart: ``final_peak_bytes``), worker 0
    builds a whole copy of a served (hybrid) or sharded (fsdp) model only when the script has an
    evaluate() to run it: without one its peak stays that of worker 1, which evaluates nothing;
    with one the copy is there (what shows the measurement sees it)."""
    script = write_script(tmp_path, TABLE + (EVALUATE if evaluate else ""))
    run_dir = str(tmp_path / "run")
    code, out = hpar_to_file(
        tmp_path / "out.txt", "run", script, "--gpus", "2", "--strategy", strategy, "--run-dir", run_dir
    )
    assert not kill_left(run_dir), "processes left behind"
    assert code == 0, out
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    final = {r["rank"]: r["final_peak_bytes"] for r in rows if r["kind"] == "memory" and r["role"] == "worker"}
    table = 4 * 50_000 * 512
    # worker 1 writes its part as worker 0 does (fsdp: its shards; hybrid: the dense part) and evaluates nothing
    if evaluate:
        assert final[0] - final[1] > 0.9 * table, final
    else:
        assert final[0] - final[1] < 0.3 * table, final
