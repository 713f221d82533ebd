"""The verdict of benchmarks/auto_table.py, which BENCHMARKS' table of `--strategy auto` against
the bench rests on: a point passes when auto's strategy measured within the fastest's spread."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from auto_table import verdict  # noqa: E402


def _row(sps, low, high, pred=None, ran_as=None, name=""):
    return {"sps": sps, "low": low, "high": high, "pred_sps": pred, "ran_as": ran_as or name}


def test_auto_within_the_fastest_spread_passes_and_below_it_fails():
    rows = {
        "hybrid": _row(900, 850, 1000, 1000, name="hybrid"),
        "allreduce": _row(800, 700, 860, 400, name="allreduce"),
        "ps": _row(500, 480, 520, 600, name="ps"),
    }
    near = verdict(rows, {"strategy": "allreduce"})  # its best round (860) reaches the fastest's worst (850)
    assert near["pass"] and near["fastest"] == "hybrid" and near["ratio"] == pytest.approx(800 / 900)
    assert near["model_error"] == pytest.approx(((1000 / 900 - 1) + (1 - 400 / 800) + (600 / 500 - 1)) / 3)
    assert near["model_ranks_fastest"]
    far = verdict(rows, {"strategy": "ps"})
    assert not far["pass"] and far["ratio"] == pytest.approx(500 / 900)


def test_a_strategy_run_as_another_and_failures_are_judged_by_what_ran():
    rows = {
        "hybrid": _row(900, 850, 1000, name="hybrid", ran_as="allreduce"),
        "fsdp": _row(950, 900, 990, 2000, name="fsdp"),
    }
    ran = verdict(rows, {"strategy": "allreduce"})  # hybrid with nothing on servers runs as allreduce
    assert ran["ran"] == "hybrid" and ran["pass"] and ran["fastest"] == "fsdp" and ran["model_ranks_fastest"]
    assert not verdict({"error": "bench exit 1"}, {"strategy": "hybrid"})["pass"]
    assert not verdict(rows, {"error": "run exit 2"})["pass"]


def test_a_row_run_as_another_strategy_is_never_the_fastest_nor_in_the_models_error():
    """examples/cnn.py on 4 workers (2026-11-28): allreduce-sparse and hybrid have nothing to do
    differently and run as allreduce, so their rounds are allreduce's measured again; auto's
    allreduce is judged against the strategies that ran as themselves."""
    rows = {
        "allreduce": _row(5097, 5097, 5449, 12221, name="allreduce"),
        "allreduce-sparse": _row(5887, 5887, 7075, 11584, name="allreduce-sparse", ran_as="allreduce"),
        "ps": _row(3236, 3236, 3261, 3669, name="ps"),
    }
    got = verdict(rows, {"strategy": "allreduce"})
    assert got["pass"] and got["fastest"] == "allreduce" and got["ran"] == "allreduce" and got["ratio"] == 1.0
    assert got["model_error"] == pytest.approx(((12221 / 5097 - 1) + (3669 / 3236 - 1)) / 2)
    assert got["model_ranks_fastest"]
