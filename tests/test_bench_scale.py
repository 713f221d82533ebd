"""hpar bench --scale (launcher/bench/scale.py): one bench per emulated host count with the cost
model's predictions beside the measurements, the emulated cluster the model is given, the
rankings, and the scripts that turn a scale.json into BENCHMARKS.md tables and re-predict it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from conftest import finite_positive, hpar, hpar_to_file, write_script

SCALE_LM = """
import torch, torch.nn as nn, torch.nn.functional as F
HPAR = {"batch_size": 8, "lr": 0.1}
class M(nn.Module):
    def __init__(self):
        super().__init__(); self.emb = nn.Embedding(2000, 8); self.out = nn.Linear(8, 4)
    def forward(self, x): return self.out(self.emb(x).mean(1))
def model(): return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        x = torch.randint(0, 2000, (batch_size, 3), generator=g)
        yield x, x[:, 0] % 4
def loss(o, t): return F.cross_entropy(o, t)
"""


@pytest.mark.multiprocess
@pytest.mark.netns
@pytest.mark.timeout(400)
def test_scale_runs_one_bench_per_host_count_with_predictions(tmp_path):
    """`hpar bench --scale 1,2` (launcher/bench/scale.py): a point per strategy and host count,
    one worker per emulated host, with measured and predicted samples/s and bytes; the 1-host
    point moves nothing between workers, the 2-host AllReduce does. The links run behind the
    per-flow fair queue (--link-queue fair, scripts/linkqueue.py), as the kernel reports."""
    from support import netns_hosts

    reason = netns_hosts.testhosts.unavailable()
    if reason:
        pytest.skip(reason)
    script = write_script(tmp_path, SCALE_LM, "lm.py")
    out = tmp_path / "scale.json"
    code, log = hpar_to_file(
        tmp_path / "stdout.txt",
        "bench",
        script,
        "--scale",
        "1,2",
        "--strategies",
        "allreduce",
        "--steps",
        "4",
        "--link-rate",
        "100mbit",
        "--link-queue",
        "fair",
        "--bench-dir",
        str(tmp_path / "b"),
        "--json",
        str(out),
        timeout=380,
    )
    assert code == 0, log[-3000:]
    assert "scaling, one worker per emulated host" in log and "cost model: mean absolute error" in log
    settings = json.load(open(out))["settings"]
    assert settings["link_queue"] == "fair"
    assert [settings["emulation"][n]["root_qdisc"] for n in ("1", "2")] == ["htb", "htb"], settings["emulation"]
    points = json.load(open(out))["points"]
    assert [(p["strategy"], p["workers"]) for p in points] == [("allreduce", 1), ("allreduce", 2)]
    assert json.load(open(out))["rankings"] == []  # one strategy: nothing to rank
    for p in points:
        assert finite_positive(p["samples_per_s"]) and finite_positive(p["predicted_samples_per_s"]), p
    assert not points[0]["bytes_sent"] and points[1]["bytes_sent"] > 2000 * 8 * 4  # the dense table is AllReduced
    assert os.path.isdir(tmp_path / "b" / "hosts-1") and os.path.isdir(tmp_path / "b" / "hosts-2")
    # the cost model's link on 2 hosts is the emulated link as measured: TCP gets at most the cap
    probe = json.load(open(out))["settings"]["link_probe"]
    assert probe["1"] is None and 0.5 * 12.5e6 < probe["2"]["bandwidth_Bps"] < 1.05 * 12.5e6, probe
    # and a two-rank AllGather through it (both directions at once), which prices allreduce-sparse
    assert 0.2 * 12.5e6 < probe["2"]["allgather_Bps"] < 1.05 * 12.5e6, probe
    # and the fixed time of a sparse gradient's exchange over both hosts (gloo's sparse AllReduce of one row)
    assert 0 < probe["2"]["sparse_round_s"] < 1.0, probe
    saved = json.load(open(tmp_path / "b" / "hosts-2" / "lm-profile.json"))["cluster"]
    assert (
        saved["allgather_Bps"] == probe["2"]["allgather_Bps"] and saved["bandwidth_Bps"] == probe["2"]["bandwidth_Bps"]
    )
    assert saved["sparse_round_s"] == probe["2"]["sparse_round_s"]
    # and the script's own exchange (its embedding table at the rows a batch touches, its dense
    # buckets beside it) over both hosts
    assert 0 < saved["gradient_exchange_s"] < 1.0, saved
    assert json.load(open(tmp_path / "b" / "hosts-1" / "lm-profile.json"))["cluster"]["gradient_exchange_s"] is None
    assert (
        "this script's gradient exchange (sparse tables and dense buckets) over 2 hosts, measured at its own sizes"
        in log
    )
    assert "emulated link measured at" in log


def test_emulated_hosts_talk_within_a_host_over_loopback_not_the_capped_link():
    """On emulated hosts a worker and its host's server share this machine's loopback: the
    cost model's intra-host rate is the probed loopback, not --link-rate (the capped rate made
    every hybrid step pay a server 'copying' its traffic at 50 Mbit/s: 0.36 s of CPU that was
    not there), and the hosts share this machine's cores."""
    from hpar.launcher.bench.bench_setup import cluster_factory

    c = cluster_factory(None, "10.77.99.2:1,10.77.99.3:1", 6.25e6, None, None, 2, 2)(2)
    assert c.hosts == 2 and c.bandwidth_Bps == 6.25e6 and c.intra_Bps > 10 * 6.25e6
    assert c.cores_per_host == pytest.approx((os.cpu_count() or 1) / 2)
    # with the link as measured between the hosts, the model takes it (and its latency) over the cap
    from hpar.strategies.plan.probe import LinkFigures

    link = LinkFigures(5.9e6, 1e-4, 5.8e6, 3.1e6)
    m = cluster_factory(None, "10.77.99.2:1,10.77.99.3:1", 6.25e6, None, None, 2, 2, link)(2)
    assert m.bandwidth_Bps == 5.9e6 and m.latency_s == 1e-4 and m.source == "probe between emulated hosts"
    assert m.allgather_Bps == 3.1e6 and m.gather_Bps == 3.1e6  # and the AllGather as measured
    assert m.sparse_round_s is None  # not probed here
    m = cluster_factory(None, "10.77.99.2:1,10.77.99.3:1", 6.25e6, None, None, 2, 2, link._replace(sparse_round_s=0.01))
    assert (
        m(2).sparse_round_s == 0.01 and m(4).sparse_round_s is None
    )  # measured over 2 hosts: not for a projection to 4


def test_scale_rankings_compare_measured_and_predicted_orders():
    from hpar.launcher.bench.scale import ScalePoint, rankings

    P = lambda strategy, n, meas, pred, ran_as=None: ScalePoint(
        "lm.py", strategy, n, meas, pred, 1.0, 1.0, None, ran_as
    )
    pts = [
        P("hybrid", 4, 300.0, 280.0),
        P("allreduce-sparse", 4, 150.0, 160.0),
        P("allreduce", 4, 20.0, 25.0),
        P("hybrid", 8, 500.0, 200.0),
        P("allreduce-sparse", 8, 180.0, 260.0),
        P("allreduce", 8, 10.0, None),
        P("hybrid", 1, 90.0, 95.0),
        P("ps", 1, 100.0, 99.0, ran_as="allreduce"),
    ]
    rows = rankings(pts)
    assert [(r["workers"], r["measured"], r["predicted"], r["agree"]) for r in rows] == [
        (4, ["hybrid", "allreduce-sparse", "allreduce"], ["hybrid", "allreduce-sparse", "allreduce"], True),
        (8, ["hybrid", "allreduce-sparse"], ["allreduce-sparse", "hybrid"], False),
    ]  # 1 worker: a single contender


def test_scale_flag_errors_are_one_line(tmp_path):
    for args, flag in (
        (["--scale", "0,2"], "--scale"),
        (["--scale", "1,2", "--gpus", "4"], "drop --gpus"),
        (["--scale", "1,2", "--link-queue", "fair"], "give --link-rate"),
    ):
        out = hpar("bench", write_script(tmp_path), "--bench-dir", str(tmp_path / "b"), *args, timeout=50)
        assert out.returncode == 2 and flag in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert not (tmp_path / "b").exists()


def test_emulated_hosts_share_the_cores_out_and_every_run_gets_them():
    """Every emulated host sees all of this machine's cores; `hpar run` would give each host's
    processes all of them (8 hosts: 8x too many OpenMP threads, cnn.py's allreduce 7x slower). The
    bench passes cpu_count / (workers + one server per host) threads, at least 1, to every run."""
    from hpar.launcher.bench.bench_config import BenchConfig
    from hpar.launcher.bench.driver import run_command
    from hpar.launcher.bench.emulate import EmulatedCluster

    assert EmulatedCluster(8, 8, None).threads == max(1, (os.cpu_count() or 1) // 16)
    assert EmulatedCluster(1, 1, None).threads == max(1, (os.cpu_count() or 1) // 2)
    cfg = BenchConfig(scripts=("lm.py",), gpus=8, strategies=("allreduce",), steps=4, bench_dir="b", threads=1)
    cmd = run_command("lm.py", "allreduce", cfg, 32, "r")
    assert cmd[cmd.index("--env") + 1] == "OMP_NUM_THREADS=1"
    assert "--env" not in run_command("lm.py", "allreduce", dataclasses.replace(cfg, threads=None), 32, "r")


def test_bench_markdown_renders_a_scale_document(tmp_path):
    """`python benchmarks/bench_markdown.py scale.json` (the tables of BENCHMARKS.md): one row per
    script and worker count, the median run with the slowest-fastest range, the prediction and
    predicted/measured, and per script the model's mean error and the orders."""
    doc = {
        "command": "hpar bench lm.py --scale 1,2 --repeat 2",
        "machine": {"cpu_count": 2, "cpu_model": "X", "torch": "t"},
        "points": [
            {
                "script": "/a/lm.py",
                "strategy": "hybrid",
                "workers": 1,
                "samples_per_s": 100.0,
                "predicted_samples_per_s": 150.0,
                "runs": [100.0, 120.0],
                "reason": None,
                "ran_as": None,
            },
            {
                "script": "/a/lm.py",
                "strategy": "allreduce",
                "workers": 1,
                "samples_per_s": 50.0,
                "predicted_samples_per_s": 50.0,
                "runs": [50.0, 55.0],
                "reason": None,
                "ran_as": None,
            },
            {
                "script": "/a/lm.py",
                "strategy": "hybrid",
                "workers": 2,
                "samples_per_s": None,
                "predicted_samples_per_s": 90.0,
                "runs": [],
                "reason": "timed out after 600 s",
                "ran_as": None,
            },
        ],
        "rankings": [
            {
                "script": "/a/lm.py",
                "workers": 1,
                "measured": ["hybrid", "allreduce"],
                "predicted": ["hybrid", "allreduce"],
                "agree": True,
                "agree_beyond_spread": True,
            }
        ],
    }
    path = tmp_path / "scale.json"
    path.write_text(json.dumps(doc))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, os.path.join(repo, "benchmarks", "bench_markdown.py"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "| script | workers | hybrid | allreduce |" in lines
    assert "| lm.py | 1 | 100 [100-120] (150, 1.50) | 50 [50-55] (50, 1.00) |" in lines
    assert "| lm.py | 2 | n/a (timed out after 600 s) | - |" in lines
    assert (
        "- lm.py: mean absolute error 25% over 2 points; order as measured at 1 of 1 points, where the runs do not overlap at 1"
        in lines
    )


def test_repredict_recomputes_the_predictions_from_the_saved_profiles(tmp_path):
    """`python benchmarks/repredict.py scale.json`: each measured point's prediction recomputed from
    the profile and cluster the bench saved, equal to the bench's own while the model is unchanged."""
    from conftest import embed_script
    from hpar.launcher.bench.bench_config import BenchConfig
    from hpar.launcher.bench.bench_plans import plan_script
    from hpar.strategies.plan.cluster import ClusterSpec

    script = write_script(tmp_path, embed_script())
    cfg = BenchConfig(
        scripts=(script,),
        gpus=2,
        strategies=("hybrid", "allreduce"),
        steps=4,
        bench_dir=str(tmp_path / "b" / "hosts-2"),
    )
    plan = plan_script(
        script,
        cfg,
        cfg.strategies,
        lambda g: ClusterSpec(
            hosts=2,
            gpus_per_host=(1, 1),
            servers=2,
            bandwidth_Bps=1e7,
            latency_s=1e-4,
            cores_per_host=0.5,
            request_cpu_s=1e-4,
        ),
    )
    pred = {s: 2 * plan.batch_size / plan.estimates[s].step_s for s in ("hybrid", "allreduce")}
    doc = {
        "settings": {"bench_dir": str(tmp_path / "b")},
        "points": [
            {
                "script": script,
                "strategy": s,
                "workers": 2,
                "samples_per_s": pred[s] / 2,
                "predicted_samples_per_s": pred[s],
                "ran_as": None,
            }
            for s in ("hybrid", "allreduce")
        ],
    }
    (tmp_path / "scale.json").write_text(json.dumps(doc))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, os.path.join(repo, "benchmarks", "repredict.py"), str(tmp_path / "scale.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for s in ("hybrid", "allreduce"):
        cell = f"{pred[s]:,.0f} (2.00)"
        assert f"| {s} | {pred[s] / 2:,.0f} | {cell} | {cell} |" in out.stdout, out.stdout
    assert "mean absolute error then 100% over 2, now 100% over 2 points" in out.stdout
    # a profile saved by another version, with a field this Profile lacks, still loads (and predicts the same)
    saved = next((tmp_path / "b" / "hosts-2").glob("*-profile.json"))
    doc_saved = json.loads(saved.read_text())
    doc_saved["profile"]["sparse_update_fixed_s"] = 3e-4
    saved.write_text(json.dumps(doc_saved))
    again = subprocess.run(
        [sys.executable, os.path.join(repo, "benchmarks", "repredict.py"), str(tmp_path / "scale.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and again.stdout == out.stdout, again.stderr
    # a request CPU measured again, for every saved cluster: hybrid's requests cost more, allreduce has none
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(repo, "benchmarks", "repredict.py"),
            str(tmp_path / "scale.json"),
            "--request-cpu-s",
            "0.01",
            "--replace-request-cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = {line.split(" | ")[2]: line for line in out.stdout.splitlines() if line.count(" | ") == 5}
    assert f"{pred['allreduce']:,.0f} (2.00) | {pred['allreduce']:,.0f} (2.00) |" in rows["allreduce"]
    now = float(rows["hybrid"].split(" | ")[-1].split(" (")[0].replace(",", ""))
    assert now < 0.75 * pred["hybrid"]


def test_bench_cpu_sums_the_heartbeats_of_the_training_window_by_role(tmp_path):
    """`python benchmarks/bench_cpu.py BENCH_DIR`: per run, each process's mean CPU percent over
    the heartbeats sent while the workers trained (steps 2 .. steps-2), summed by role, and the
    CPU seconds per step that makes at the run's step time; start-up and shut-down beats, and
    runs without a summary, are left out."""
    run = tmp_path / "hosts-2" / "job" / "hybrid"
    run.mkdir(parents=True)
    (tmp_path / "hosts-2" / "job" / "ps").mkdir()  # no summary: no row
    (run / "summary.json").write_text(json.dumps({"steps": 20, "samples_per_s": 64.0}))
    (run / "config.json").write_text(json.dumps({"batch_size": 16, "world_size": 2}))  # 0.5 s a step
    beat = lambda role, rank, t, step, pct: json.dumps(
        {"kind": "heartbeat", "role": role, "rank": rank, "time": t, "at_step": step, "cpu_percent": pct}
    )
    lines = [
        beat("worker", 0, 0.0, 0, 300.0),
        beat("server", 0, 0.5, 0, 300.0),  # start-up: before the window
        beat("worker", 0, 1.0, 2, 40.0),
        beat("worker", 1, 1.5, 3, 50.0),
        beat("server", 0, 2.0, 0, 10.0),
        beat("worker", 0, 3.0, 10, 60.0),
        beat("worker", 1, 3.5, 12, 70.0),
        beat("server", 0, 4.0, 0, 30.0),
        beat("worker", 0, 6.0, 18, 80.0),
        json.dumps({"kind": "metric", "step": 10}),
        beat("worker", 1, 9.0, 20, 400.0),
    ]  # the last steps: after it
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import bench_cpu
    finally:
        sys.path.pop(0)
    got = bench_cpu.run_cpu(str(run))
    assert got["workers_pct"] == pytest.approx(60.0 + 60.0) and got["servers_pct"] == pytest.approx(20.0)
    assert got["step_s"] == pytest.approx(0.5) and got["worker_cpu_s"] == pytest.approx(0.6)
    assert got["server_cpu_s"] == pytest.approx(0.1) and got["processes"] == 3
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, os.path.join(repo, "benchmarks", "bench_cpu.py"), str(tmp_path), "--cores", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[2:] == ["| hosts-2/job/hybrid | 500.0 | 120 | 20 | 600.0 + 100.0 | 70% |"]
