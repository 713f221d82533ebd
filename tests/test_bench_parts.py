"""hpar bench's parts without a run: the byte check's window and interpolation, socket totals,
the command each entry runs (micro-batches, the planner's plan, --min-seconds), the verdict and the
spread of repeated runs."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from conftest import write_script
from hpar.launcher.bench.driver import Result


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
