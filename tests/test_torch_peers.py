"""torch.distributed.pipelining's schedules as hpar's peers (strategies/runtimes/pipeline/torch_peers.py):
the interleaved 1F1B and ZB-V zero-bubble schedules run through `hpar run` with two chunks per
process, train the same math as hpar's 1F1B, and report the bubble and peak memory per stage
that `hpar bench` prints."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.torch_version import TorchVersion

from conftest import REPO, hpar, hpar_to_file, kill_left, final_state
from hpar.launcher.bench.plots import stage_figures
from hpar.strategies.runtimes.pipeline.torch_peers import chunk_ranks
from hpar.strategies.plan.stage_cuts import ZBV_GLOO_MIN_TORCH, check_peer

PIPE = os.path.join(REPO, "tests", "zoo", "pipe4.py")  # 8 layers: 2 processes x 2 chunks x 2 layers
SCHEDULES = ("torch-interleaved-1f1b", "torch-zbv")
ZBV_ON_GLOO = TorchVersion(torch.__version__) >= ZBV_GLOO_MIN_TORCH  # check_peer refuses it before (self-send)


def test_chunk_placement():
    assert chunk_ranks("torch-1f1b", 3) == [0, 1, 2]
    assert chunk_ranks("torch-interleaved-1f1b", 3) == [0, 1, 2, 0, 1, 2]  # the "loop" placement
    assert chunk_ranks("torch-zbv", 3) == [0, 1, 2, 2, 1, 0]  # the "V": rank 0 holds first and last


@pytest.mark.parametrize(
    "schedule, layers, ranks, micro, flag",
    [
        ("torch-zbv", 7, 4, 4, "8 chunks"),
        ("torch-interleaved-1f1b", 4, 4, 4, "8 chunks"),
        ("torch-1f1b", 8, 4, 2, "--micro-batches 2"),
        ("torch-interleaved-1f1b", 8, 2, 5, "multiple of 2"),
    ],
)
def test_check_peer_refuses_with_the_fix(schedule, layers, ranks, micro, flag):
    with pytest.raises(ValueError, match=flag):
        check_peer(schedule, layers, ranks, micro, "cuda")
    check_peer("torch-zbv", 8, 4, 4, "cuda")  # enough layers: no error


def test_zbv_on_gloo_needs_torch_2_12():
    """torch 2.11's ZB-V sends from a process to itself, which gloo refuses (seen on the GPU
    machine's torch 2.11.0 with --device cpu); NCCL and later torch versions run it."""
    with pytest.raises(
        ValueError, match="--schedule torch-zbv on CPU \\(gloo\\) needs torch 2.12 or later .*torch-interleaved-1f1b"
    ):
        check_peer("torch-zbv", 8, 4, 4, "cpu", "2.11.0+cu130")
    check_peer("torch-zbv", 8, 4, 4, "cpu", "2.12.0")
    check_peer("torch-zbv", 8, 4, 4, "cuda", "2.11.0+cu130")
    check_peer("torch-interleaved-1f1b", 8, 4, 4, "cpu", "2.11.0")


def test_stage_figures_from_a_summary():
    summary = {
        "stages": [
            {"compute_s": 3.0, "idle_s": 1.0, "peak_mem_bytes": 10},
            {"compute_s": 2.0, "idle_s": 2.0, "peak_mem_bytes": 30},
        ]
    }
    assert stage_figures(summary) == {"bubble": pytest.approx(3 / 8), "peak_mem_bytes": 30}
    assert stage_figures({"stages": [{"compute_s": 1.0, "idle_s": None, "peak_mem_bytes": None}]}) == {}
    assert stage_figures({"strategy": "allreduce"}) == {}


@pytest.fixture(scope="module")
def reference():
    """hpar's 1F1B on 2 stages, simulated in this process (tests/test_pipeline.py checks the
    simulator against the multi-process runtime bit for bit)."""
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.runtimes.pipeline.sim import simulate

    job = load_job(PIPE)
    return simulate(job, "1f1b", 2, steps=6, batch_size=8, micro_batches=4, lr=job.defaults["lr"]).model


def run_schedule(tmp_path_factory, schedule: str) -> dict:
    """One `hpar run --gpus 2` of the 8-layer zoo model with ``schedule``, stdout to a file
    (each test runs its own schedule only: a module fixture running them all was run again by
    every pytest-xdist process that drew one of these tests)."""
    base = tmp_path_factory.mktemp(schedule)
    run_dir = base / "run"
    rc, log = hpar_to_file(
        base / "stdout.txt",
        "run",
        PIPE,
        "--gpus",
        "2",
        "--strategy",
        "pipeline",
        "--schedule",
        schedule,
        "--micro-batches",
        "4",
        "--steps",
        "6",
        "--run-dir",
        str(run_dir),
        "--no-eval",
        cwd=str(base),
    )
    return {"rc": rc, "log": log, "left": kill_left(run_dir), "run_dir": run_dir}


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_chunks_per_process_train_the_same_model_as_1f1b(tmp_path_factory, reference, schedule):
    if schedule == "torch-zbv" and not ZBV_ON_GLOO:
        pytest.skip(
            f"torch {torch.__version__}: --schedule {schedule} on gloo needs torch 2.12 (test_zbv_on_gloo_needs_torch_2_12)"
        )
    r = run_schedule(tmp_path_factory, schedule)
    assert r["rc"] == 0, r["log"][-2000:]
    assert not r["left"], f"processes left: {r['left']}"
    assert "2 chunks per process" in r["log"]
    got = final_state(r["run_dir"])
    want = reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:  # same micro-batches, same 1/M scaling, one optimizer step per batch
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    summary = json.loads((r["run_dir"] / "summary.json").read_text())
    stages = summary["stages"]
    assert [s["stage"] for s in stages] == [0, 1] and all(len(s["layers"]) == 2 for s in stages)
    figures = stage_figures(summary)
    assert 0.0 <= figures["bubble"] < 1.0 and figures["peak_mem_bytes"] >= 0


def test_too_few_layers_for_two_chunks_is_refused_before_anything_starts(tmp_path):
    r = hpar(
        "run",
        PIPE,
        "--gpus",
        "8",
        "--strategy",
        "pipeline",
        "--schedule",
        "torch-zbv",
        "--micro-batches",
        "8",
        "--batch-size",
        "8",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--schedule torch-zbv cuts the model into 16 chunks" in r.stderr + r.stdout
    assert not (tmp_path / "run" / "config.json").exists()
