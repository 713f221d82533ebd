"""hpar bench: strategy names, byte accounting from metrics, ratios, flag errors, and one real
bench of a tiny job with 2 workers (JSON shape, positive finite numbers, reasons, PNG)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from conftest import finite_positive, hpar, hpar_to_file, run_processes, write_script
from hpar.launcher.bench.bench_config import BENCH_STRATEGIES, bench_entry, parse_strategies, row_dir, with_compress
from hpar.launcher.bench.driver import Result, with_ratios
from hpar.launcher.bench.plots import bytes_per_worker_step
from hpar.launcher.bench.emulate import rate_arg
from hpar.launcher.hosts.emulated import parse_emulate

# Not a sequence of layers (a custom forward), so no pipeline applies.
TINY_TREE = """
import torch, torch.nn as nn
HPAR = {"steps": 20, "batch_size": 8, "lr": 0.1, "log_every": 2}
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)
    def forward(self, x):
        h = self.emb(x).mean(1)
        return self.b(torch.tanh(self.a(h)) + h)
def model():
    return Net()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(10_000):
        x = torch.randint(0, 50, (batch_size, 3), generator=g)
        yield x, (x.float().mean(1, keepdim=True) / 50)
def loss(output, targets):
    return ((output - targets) ** 2).mean()
"""


def test_parse_strategies():
    assert parse_strategies(None) == tuple(BENCH_STRATEGIES)
    assert parse_strategies("hybrid, allreduce,hybrid") == ("hybrid", "allreduce")
    assert BENCH_STRATEGIES["torch-1f1b"] == ("pipeline", "torch-1f1b")
    with pytest.raises(ValueError, match="--strategies: unknown horovod"):
        parse_strategies("hybrid,horovod")


def test_bytes_per_worker_step_weights_intervals(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"kind": "metric", "role": "worker", "rank": 0, "step": 2, "bytes_sent": 100.0, "bytes_recv": 10.0},
        {"kind": "metric", "role": "worker", "rank": 0, "step": 8, "bytes_sent": 200.0, "bytes_recv": 10.0},
        {"kind": "metric", "role": "worker", "rank": 1, "step": 8, "bytes_sent": 300.0, "bytes_recv": 30.0},
        {"kind": "heartbeat", "role": "worker", "rank": 1, "cpu_percent": 3.0},
        {"kind": "metric", "role": "server", "rank": 0, "step": 8, "bytes_sent": 1e9},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    got = bytes_per_worker_step(str(path))
    # rank 0: (2*100 + 6*200)/8 = 175; rank 1: 300; mean over workers
    assert got == pytest.approx({"sent": (175 + 300) / 2, "recv": (10 + 30) / 2})
    assert bytes_per_worker_step(str(tmp_path / "missing.jsonl")) is None


def test_ratios_are_per_script_and_skip_unrun():
    rs = with_ratios(
        [
            Result("a.py", "allreduce", samples_per_s=50.0),
            Result("a.py", "hybrid", samples_per_s=200.0),
            Result("a.py", "pipeline-1f1b", reason="not a sequence"),
            Result("b.py", "ps", samples_per_s=7.0),
        ]
    )
    assert [r.ratio for r in rs] == [0.25, 1.0, None, 1.0]


def test_a_row_that_ran_as_another_strategy_never_sets_the_fastest():
    # a hybrid plan with nothing on its servers runs as allreduce: its (noisy) speed is not a
    # second allreduce that may beat the first, so the ratios are against the real contenders
    rs = with_ratios(
        [
            Result("a.py", "allreduce", samples_per_s=100.0),
            Result("a.py", "hybrid", samples_per_s=110.0, extra={"ran_as": "allreduce"}),
            Result("a.py", "ps", samples_per_s=50.0),
        ]
    )
    assert [r.ratio for r in rs] == [1.0, 1.1, 0.5]


def test_emulate_spec():
    assert parse_emulate("emulate:2") == 2 and parse_emulate("a:2,b:2") is None and parse_emulate(None) is None
    with pytest.raises(ValueError, match="emulate:H"):
        parse_emulate("emulate:x")
    assert rate_arg(1.25e8) == "1000000000bit"


def test_exchange_items_follow_backward_with_tables_alone_and_dense_layers_in_ddp_buckets():
    """What the gradient exchange probe puts in flight for allreduce-sparse, in the order
    backward produces it: examples/lm.py's shape (an input embedding at layer 0, dense layers,
    a tied-free output table and bias at the top) gives the top tables first, one bucket of the
    dense layers, then the input table; dense layers beyond 25 MB split into buckets."""
    from hpar.strategies.plan.probe import exchange_items
    from hpar.strategies.profile.profiler import ParamProfile, Profile

    table = lambda name, layer, shape, alpha: ParamProfile(
        name, shape, 4 * math.prod(shape), True, alpha, alpha, True, layer
    )
    dense = lambda name, layer, n: ParamProfile(name, (n,), 4 * n, False, 1.0, 1.0, False, layer)
    params = (
        table("emb", 0, (1000, 16), 0.05),
        table("out_w", 3, (1000, 16), 0.1),
        table("out_b", 4, (1000,), 0.1),
        dense("lstm", 1, 300),
        dense("proj", 2, 20),
    )
    prof = Profile(params, (), 8, 8, 4, False, "x", 0.3, 0.1, 0.2, 10, 20, 1e-9, 8)
    assert exchange_items(prof) == [[100, 1, 1000], [100, 16, 1000], [320], [50, 16, 1000]]
    big = dataclasses.replace(prof, params=(dense("a", 1, 4_000_000), dense("b", 2, 4_000_000), dense("c", 3, 1)))
    assert exchange_items(big) == [[4_000_001], [4_000_000]]  # 16 MB + 16 MB > DDP's 25 MB bucket


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--strategies", "allreduce,nope"], "--strategies"),
        (["--steps", "2"], "--steps"),
        (["--gpus", "0"], "--gpus"),
        (["--link-rate", "fast"], "--link-rate"),
        (["--hosts", "emulate:0"], "emulate:H"),
        (["--link-queue", "fair"], "--link-queue"),
        (["--hosts", "emulate:2", "--link-queue", "fair"], "--link-rate"),
        (["--repeat", "0"], "--repeat"),
        (["--min-seconds", "-1"], "--min-seconds"),
        (["--compress", "zip"], "--compress"),
        (["--strategies", "ps", "--compress", "fp16"], "--compress"),
    ],
)
@pytest.mark.timeout(60)
def test_bad_flags_are_one_line_errors(tmp_path, args, flag):
    out = hpar("bench", write_script(tmp_path), "--bench-dir", str(tmp_path / "b"), *args, timeout=50)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpar: ") and flag in lines[0], out.stderr
    assert not (tmp_path / "b").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_bench_tiny_job_in_rounds_json_and_plot(tmp_path):
    """The real `hpar bench --repeat 2`, stdout to a file: each strategy runs twice, in rounds
    (its own run directories), the table shows the median and the spread, the JSON keeps both
    runs with the machine, the predictions and the bytes, the plot is a PNG, a pipeline is
    skipped with its reason, and no process is left."""
    script = write_script(tmp_path, TINY_TREE)
    ran = ["allreduce", "hybrid"]
    names = ran + ["pipeline-1f1b"]
    bench_dir, out_json, out_png = tmp_path / "bench", tmp_path / "out.json", tmp_path / "out.png"
    code, log = hpar_to_file(
        tmp_path / "stdout.txt",
        "bench",
        script,
        "--gpus",
        "2",
        "--steps",
        "6",
        "--strategies",
        ",".join(names),
        "--repeat",
        "2",
        "--link-rate",
        "10gbit",
        "--project",
        "8",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
        "--bench-dir",
        str(bench_dir),
        "--min-seconds",
        "0.3",
        timeout=460,
    )
    assert code == 0, log[-3000:]
    doc = json.loads(out_json.read_text())
    assert doc["torch"] and doc["machine"]["cpu_count"] >= 1 and doc["machine"]["memory_bytes"] > 0
    assert doc["date"] and "bench" in doc["command"] and doc["settings"]["repeat"] == 2
    order = [
        line.split("hpar bench: job ", 1)[1].split(":")[0]
        for line in log.splitlines()
        if line.startswith("hpar bench: job ") and "running (2 workers" in line
    ]
    assert order == [f"{n}-run{i}" for i in (1, 2) for n in ran], order  # rounds: every strategy once each
    by_name = {r["strategy"]: r for r in doc["results"]}
    assert list(by_name) == names
    plan = json.loads((bench_dir / "job-hybrid-plan.json").read_text())
    for name in ran:
        r = by_name[name]
        assert r["reason"] is None, r
        for key in ("samples_per_s", "step_s_p50", "step_s_p90", "predicted_step_s", "ratio"):
            assert finite_positive(r[key]), (name, key, r[key])
        assert r["step_s_p90"] >= r["step_s_p50"]
        assert r["ratio"] <= 1.0 or r["extra"].get("ran_as")  # a "ran as" row is no contender: it may read above 1
        assert finite_positive(r["bytes_per_step"]["sent"]) and finite_positive(r["bytes_per_step"]["recv"])
        assert r["projected"]["projected"] is True and finite_positive(r["projected"]["samples_per_s"])
        runs = r["extra"]["runs_samples_per_s"]
        assert len(runs) == 2 and all(finite_positive(x) for x in runs) and r["samples_per_s"] == min(runs), r
        assert f"{min(runs):,.0f}-{max(runs):,.0f}" in log
        assert r["run_dir"] in {str(bench_dir / "job" / f"{name}-run{i}") for i in (1, 2)}
        ran_as = name
        if name == "hybrid" and "ps" not in plan["placement"].values():
            ran_as = "allreduce"  # the plan keeps every parameter on AllReduce: no idle server
        assert r["extra"].get("ran_as", name) == ran_as
        # --min-seconds 0.3: enough steps for 0.3 s at the predicted step time (a few ms here)
        want_steps = max(6, 2 + math.ceil(0.3 / r["predicted_step_s"]))
        assert r["extra"]["steps"] == want_steps > 6
        for i in (1, 2):
            summary = json.loads((bench_dir / "job" / f"{name}-run{i}" / "summary.json").read_text())
            assert summary["strategy"] == ran_as and summary["steps"] == want_steps and summary["world_size"] == 2
            assert run_processes(str(bench_dir / "job" / f"{name}-run{i}")) == []
            assert not (bench_dir / "job" / f"{name}-run{i}" / "model").exists()  # removed once read (--keep-models)
    assert max(by_name[n]["ratio"] for n in ran if not by_name[n]["extra"].get("ran_as")) == 1.0
    pipe = by_name["pipeline-1f1b"]
    assert pipe["samples_per_s"] is None and pipe["reason"].startswith(
        "not a sequence of layers: it has no repeated blocks"
    )
    assert not list((bench_dir / "job").glob("pipeline-1f1b*"))
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 5000
    assert "pipeline-1f1b: skipped" in log and "x fastest" in log
    assert log.rstrip().splitlines()[-1] == (
        f"hpar bench: the runs (logs, metrics, summaries) are in {bench_dir}; their "
        "models were removed once read (--keep-models keeps them)"
    )


WIDE_SEQ = """
import torch, torch.nn as nn
HPAR = {"steps": 6, "batch_size": 16, "lr": 0.01, "log_every": 3}
def model():
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        x = torch.randn(batch_size, 512, generator=g)
        yield x, x
def loss(o, t): return ((o - t) ** 2).mean()
def optimizer(params): return torch.optim.SGD(params, lr=0.01, momentum=0.9)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_bench_runs_fsdp_beside_allreduce_and_a_pipeline_with_their_peaks(tmp_path):
    """hpar bench's fsdp row runs torch's FSDP2 beside allreduce and pipeline-1f1b; every row
    has its measured and predicted peak per worker (JSON), and --memory prints them side by side."""
    script = write_script(tmp_path, WIDE_SEQ)
    out_json = tmp_path / "out.json"
    out = hpar(
        "bench",
        script,
        "--gpus",
        "2",
        "--steps",
        "4",
        "--strategies",
        "allreduce,fsdp,pipeline-1f1b",
        "--link-rate",
        "10gbit",
        "--memory",
        "--json",
        str(out_json),
        "--bench-dir",
        str(tmp_path / "b"),
        timeout=400,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {r["strategy"]: r for r in json.loads(out_json.read_text())["results"]}
    assert list(rows) == ["allreduce", "fsdp", "pipeline-1f1b"] and all(r["reason"] is None for r in rows.values())
    for r in rows.values():
        assert finite_positive(r["extra"]["peak_bytes"]["worker"]) and r["extra"]["peak_bytes"]["server"] is None
        assert finite_positive(r["extra"]["predicted_peak_bytes"]["worker"])
        assert r["extra"]["memory_terms"]["worker"]["params"] > 0
    assert rows["fsdp"]["extra"]["memory_terms"]["worker"]["params"] == 4 * 4 * (512 * 512 + 512) // 2  # a half each
    assert "Peak memory per process, predicted and measured" in out.stdout and "peak/wkr" in out.stdout
    assert json.loads((tmp_path / "b" / "job" / "fsdp" / "summary.json").read_text())["strategy"] == "fsdp"


def test_compress_rows_follow_each_strategy_that_can_compress():
    names = with_compress(("hybrid", "ps", "allreduce"), "fp16,off,powersgd:2,fp16")
    assert names == (
        "hybrid",
        "hybrid --compress fp16",
        "hybrid --compress powersgd:2",
        "ps",
        "allreduce",
        "allreduce --compress fp16",
        "allreduce --compress powersgd:2",
    )
    assert with_compress(("ps",), "off") == ("ps",) and with_compress(("ps",), None) == ("ps",)
    assert bench_entry("hybrid --compress powersgd:2") == ("hybrid", None)
    assert row_dir("hybrid --compress powersgd:2") == "hybrid-compress-powersgd-r2"
    for bad in ("zip", "powersgd:x", "fp16:2"):
        with pytest.raises(ValueError, match="--compress"):
            with_compress(("allreduce",), bad)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_bench_compress_row_beside_the_uncompressed_one(tmp_path):
    """`hpar bench --compress fp16` runs allreduce and "allreduce --compress fp16" in one bench:
    the compressed row's run has the setting, sends half the bytes per worker per step, and both
    rows are compared in one line; no process is left."""
    script = write_script(tmp_path)
    bench_dir, out_json = tmp_path / "bench", tmp_path / "out.json"
    code, log = hpar_to_file(
        tmp_path / "stdout.txt",
        "bench",
        script,
        "--gpus",
        "2",
        "--steps",
        "4",
        "--strategies",
        "allreduce",
        "--compress",
        "fp16",
        "--link-rate",
        "10gbit",
        "--json",
        str(out_json),
        "--bench-dir",
        str(bench_dir),
        timeout=110,
    )
    assert code == 0, log[-3000:]
    doc = json.loads(out_json.read_text())
    rows = {r["strategy"]: r for r in doc["results"]}
    assert list(rows) == ["allreduce", "allreduce --compress fp16"] and doc["settings"]["compress"] == "fp16"
    for r in rows.values():
        assert r["reason"] is None and finite_positive(r["samples_per_s"]) and finite_positive(r["predicted_step_s"])
    full, half = (rows[n]["bytes_per_step"]["sent"] for n in rows)
    assert 0.45 < half / full < 0.55, (half, full)
    vs = rows["allreduce --compress fp16"]["extra"]["vs_uncompressed"]
    assert vs["of"] == "allreduce" and vs["bytes_sent"] == half / full and finite_positive(vs["samples_per_s"])
    assert f"allreduce --compress fp16: {half / full:.2f}x the bytes sent per worker per step of allreduce" in log
    run_dir = bench_dir / "job" / "allreduce-compress-fp16"
    assert json.loads((run_dir / "config.json").read_text())["compress"] == {"kind": "fp16", "rank": 0}
    assert run_processes(str(run_dir)) == [] and run_processes(str(bench_dir / "job" / "allreduce")) == []
