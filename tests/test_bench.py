"""hpar bench: strategy names, byte accounting from metrics, ratios, flag errors, and one real
bench of a tiny job with 2 workers (JSON shape, positive finite numbers, reasons, PNG)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

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
    ran = ["allreduce", "allreduce-sparse", "hybrid"]
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


def test_byte_check_window_and_interpolation(tmp_path):
    from hpar.launcher.bench.byte_counts import Sample, byte_check

    rows = []
    for step in (2, 4, 6, 8):
        t = 100.0 + step
        rows.append(
            {
                "kind": "metric",
                "role": "worker",
                "rank": 0,
                "time": t,
                "step": step,
                "bytes_sent": 1000.0,
                "bytes_sent_remote": 0.0,
            }
        )
        rows.append(
            {
                "kind": "metric",
                "role": "worker",
                "rank": 1,
                "time": t,
                "step": step,
                "bytes_sent": 3000.0,
                "bytes_sent_remote": 1500.0,
            }
        )
        rows.append(
            {
                "kind": "metric",
                "role": "server",
                "rank": 0,
                "time": t,
                "step": step,
                "bytes_sent": 500.0,
                "bytes_sent_remote": 400.0,
            }
        )
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    # counters grow 4600 bytes/s (TCP) and 2000 bytes/s (interface) over two hosts; one step per second
    # and 2 packets/s per host (66 header bytes each)
    samples = [
        Sample(
            t,
            {"h0": 1000 * t, "h1": 1000 * t},
            {"h0": 0, "h1": 0},
            {"h0": 2300 * t, "h1": 2300 * t},
            {"h0": 2 * t, "h1": 2 * t},
        )
        for t in (100.0, 103.0, 105.5, 109.0)
    ]
    got = byte_check(samples, str(tmp_path))
    assert got["steps"] == 2  # worker 0's reports at steps 4 and 6 (the last, 8, is left out)
    assert got["hpar_bytes_per_step"] == pytest.approx(4500.0)
    assert got["tcp_bytes_per_step"] == pytest.approx(4600.0)
    assert got["interface_bytes_per_step"] == pytest.approx(2000.0)
    assert got["tcp_over_hpar"] == pytest.approx(4600 / 4500)
    assert got["hpar_remote_bytes_per_step"] == pytest.approx(1900.0)
    assert got["interface_payload_bytes_per_step"] == pytest.approx(2000.0 - 4 * 66)
    assert got["interface_over_hpar_remote"] == pytest.approx((2000 - 4 * 66) / 1900)
    rows.append({"kind": "metric", "role": "worker", "rank": 0, "time": 110.0, "step": 10, "bytes_sent": 1000.0})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert byte_check(samples, str(tmp_path))["steps"] == 4  # reports 4 .. 8 now
    assert byte_check(samples[:1], str(tmp_path)) is None


def test_pipeline_entries_run_the_planned_micro_batches(tmp_path):
    """The prediction is for the plan's M; a script's HPAR micro_batches must not replace it."""
    from hpar.launcher.bench.bench_config import BenchConfig
    from hpar.launcher.bench.driver import run_command

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"strategy": "pipeline", "micro_batches": 1, "stages": [[0, 4], [4, 8]]}))
    cfg = BenchConfig(
        scripts=("wide.py",), gpus=2, strategies=("pipeline-1f1b", "allreduce"), steps=4, bench_dir=str(tmp_path)
    )
    cmd = run_command("wide.py", "pipeline-1f1b", cfg, 32, str(tmp_path / "run"), str(plan))
    assert cmd[cmd.index("--plan") + 1] == str(plan) and cmd[cmd.index("--micro-batches") + 1] == "1"
    assert cmd[cmd.index("--schedule") + 1] == "1f1b"
    assert "--micro-batches" not in run_command("wide.py", "allreduce", cfg, 32, str(tmp_path / "run"))
    assert "--precision" not in cmd  # the script's own precision
    cmd = run_command("wide.py", "allreduce", dataclasses.replace(cfg, precision="fp32"), 32, str(tmp_path / "run"))
    assert cmd[cmd.index("--precision") + 1] == "fp32"  # `hpar bench --precision fp32`


def test_socket_total_counts_growth_new_sockets_and_survives_closed_ones():
    from hpar.launcher.bench.byte_counts import socket_total

    assert socket_total({}, {"a b": 100}) == 100
    # "a b" grew by 50, "c d" closed (its last bytes are lost, the total does not drop), "e f" is new
    assert socket_total({"a b": 100, "c d": 400}, {"a b": 150, "e f": 30}) == 80
    assert socket_total({"a b": 100}, {"a b": 20}) == 20  # same addresses, a new connection


def test_min_seconds_gives_a_strategy_predicted_fast_more_steps():
    from hpar.launcher.bench.bench_config import MAX_STEPS, BenchConfig, steps_for
    from hpar.launcher.bench.driver import run_command

    cfg = BenchConfig(scripts=("a.py",), gpus=2, strategies=("allreduce",), steps=30, bench_dir="b", min_seconds=5.0)
    assert steps_for(cfg, 0.005) == 1002 and steps_for(cfg, 0.5) == 30 and steps_for(cfg, None) == 30
    assert steps_for(cfg, 1e-6) == MAX_STEPS
    assert steps_for(dataclasses.replace(cfg, min_seconds=0.0), 0.005) == 30
    cmd = run_command("a.py", "allreduce", cfg, 4, "r", steps=1002)
    assert cmd[cmd.index("--steps") + 1] == "1002" and cmd[cmd.index("--log-every") + 1] == "10"
    assert run_command("a.py", "allreduce", cfg, 4, "r")[cmd.index("--steps") + 1] == "30"


def test_hybrid_and_ps_entries_run_the_planners_plan(tmp_path):
    """The prediction next to hybrid's measurement is for the planned placement and partitions, and
    the profile and cluster it was computed from are saved beside the plans."""
    from conftest import embed_script
    from hpar.launcher.bench.bench_config import BenchConfig
    from hpar.launcher.bench.driver import run_command
    from hpar.launcher.bench.bench_plans import plan_script
    from hpar.strategies.plan.cluster import ClusterSpec

    script = write_script(tmp_path, embed_script())
    cfg = BenchConfig(
        scripts=(script,), gpus=2, strategies=("hybrid", "ps", "allreduce"), steps=4, bench_dir=str(tmp_path / "bench")
    )
    plan = plan_script(
        script,
        cfg,
        cfg.strategies,
        lambda g: ClusterSpec(hosts=1, gpus_per_host=(g,), servers=1, bandwidth_Bps=1e9, latency_s=1e-5),
    )
    assert set(plan.plan_files) == {"hybrid", "ps"}
    hybrid = json.load(open(plan.plan_files["hybrid"]))
    assert hybrid["strategy"] == "hybrid" and hybrid["placement"] == plan.estimates["hybrid"].placement
    assert hybrid["placement"]["emb.weight"] == "ps" and hybrid["placement"]["out.weight"] == "allreduce"
    cmd = run_command(script, "hybrid", cfg, 4, str(tmp_path / "run"), plan.plan_files["hybrid"])
    assert cmd[cmd.index("--plan") + 1] == plan.plan_files["hybrid"] and "--micro-batches" not in cmd
    # the profile and cluster the predictions came from are kept: the same estimate comes back from them
    from hpar.strategies.plan.costmodel_ps import estimate_hybrid
    from hpar.strategies.profile.profiler import Profile

    stem = os.path.splitext(os.path.basename(script))[0]
    saved = json.load(open(tmp_path / "bench" / f"{stem}-profile.json"))
    cluster = ClusterSpec(**{**saved["cluster"], "gpus_per_host": tuple(saved["cluster"]["gpus_per_host"])})
    again = estimate_hybrid(Profile.from_dict(saved["profile"]), cluster)
    assert again.step_s == pytest.approx(plan.estimates["hybrid"].step_s) and again.placement == hybrid["placement"]


def test_verdict_says_faster_only_beyond_the_spread_and_never_for_a_ran_as_row():
    from hpar.launcher.bench.verdict import steps_warning, verdict

    ar = Result("a.py", "allreduce", samples_per_s=100.0, step_s_p50=0.10, step_s_p90=0.12)
    hy = Result("a.py", "hybrid", samples_per_s=110.0, step_s_p50=0.09, step_s_p90=0.10, extra={"ran_as": "allreduce"})
    pipe = Result("a.py", "pipeline-1f1b", samples_per_s=105.0, step_s_p50=0.095, step_s_p90=0.10)
    slow = Result("a.py", "ps", samples_per_s=50.0, step_s_p50=0.2, step_s_p90=0.21)
    line = verdict([ar, hy, pipe, slow])
    assert line.startswith("fastest: pipeline-1f1b, ") and "hybrid" not in line  # ran as allreduce: no contender
    assert "1.05x allreduce (within the spread 1.20x" in line and "2.10x ps" in line
    assert "2.10x ps (" not in line  # beyond the spread: faster
    assert steps_warning(6) and steps_warning(30) is None


def test_repeated_runs_give_the_median_run_and_their_spread():
    """``--repeat``: a strategy's entry is its median run (the slower middle one for an even
    count), with every run's samples/s; a failed run fails the entry, saying which; the
    verdict's spread takes the runs' max/min; the scale's rankings ask only the order of
    strategies whose runs do not overlap."""
    from hpar.launcher.bench.plots import combine_runs
    from hpar.launcher.bench.scale import ScalePoint, rankings
    from hpar.launcher.bench.verdict import spread, verdict

    runs = [
        Result("a.py", "hybrid", samples_per_s=v, run_dir=f"r{i}") for i, v in enumerate((120.0, 80.0, 100.0, 90.0))
    ]
    one = combine_runs(runs)
    assert (
        one.samples_per_s == 90.0
        and one.run_dir == "r3"
        and one.extra["runs_samples_per_s"] == [120.0, 80.0, 100.0, 90.0]
    )
    assert spread(one) == pytest.approx(1.5)
    assert combine_runs(runs[:1]) is runs[0]
    failed = combine_runs([runs[0], dataclasses.replace(runs[1], samples_per_s=None, reason="timed out after 5 s")])
    assert failed.reason == "run 2 of 2: timed out after 5 s" and failed.samples_per_s is None
    # 1.2x apart but runs spread 1.5x: no winner declared
    other = Result("a.py", "allreduce", samples_per_s=75.0, step_s_p50=0.1, step_s_p90=0.1)
    assert "within the spread 1.50x" in verdict([one, other])
    P = lambda strategy, meas, pred, runs: ScalePoint("lm.py", strategy, 4, meas, pred, 1.0, 1.0, runs=runs)
    overlap = [
        P("hybrid", 100.0, 90.0, (95.0, 100.0, 130.0)),
        P("ps", 98.0, 120.0, (80.0, 98.0, 99.0)),
        P("allreduce", 10.0, 11.0, (9.0, 10.0, 12.0)),
    ]
    (row,) = rankings(overlap)
    assert row["measured"] == ["hybrid", "ps", "allreduce"] and row["predicted"] == ["ps", "hybrid", "allreduce"]
    assert row["agree"] is False and row["agree_beyond_spread"] is True  # hybrid and ps overlap: a tie
    assert overlap[0].within_spread is False and overlap[1].within_spread is False and overlap[2].within_spread is True
    apart = [P("hybrid", 100.0, 90.0, (95.0, 100.0)), P("ps", 50.0, 120.0, (40.0, 50.0))]
    assert rankings(apart)[0]["agree_beyond_spread"] is False
    assert ScalePoint("lm.py", "ps", 4, 50.0, 60.0, 1.0, 1.0).within_spread is None  # no repeats


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
