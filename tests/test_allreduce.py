"""`allreduce` (DDP) with 2 workers equals one process trained on the concatenated batches."""

import json
import os

import pytest
import torch

from hpar.strategies.job.contract import load_job

from conftest import hpar, single_process_reference, final_state

pytestmark = [pytest.mark.multiprocess]


def assert_close_state(got: dict, want: dict, rtol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for k in want:
        diff = (got[k] - want[k]).abs().max().item()
        scale = max(want[k].abs().max().item(), 1e-12)
        assert diff / scale < rtol, f"{k}: relative difference {diff / scale:.2e}"


@pytest.mark.timeout(180)
def test_two_workers_match_single_process(tiny_script, tmp_path, reap_run):
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    res = hpar(
        "run",
        tiny_script,
        "--gpus",
        "2",
        "--strategy",
        "allreduce",
        "--steps",
        "20",
        "--seed",
        "3",
        "--run-dir",
        run_dir,
        "--plain",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["strategy"] == "allreduce" and summary["world_size"] == 2 and summary["exit_code"] == 0
    assert summary["eval_last"]["mse"] < summary["eval_first"]["mse"]
    n_params = sum(p.numel() for p in load_job(tiny_script).build_model().parameters())
    # ring AllReduce: 2(N-1)/N of the gradient bytes, sent and received by each worker
    assert summary["bytes_per_step"]["sent"] == pytest.approx(2 * 1 / 2 * n_params * 4)
    got = final_state(run_dir)
    want = single_process_reference(tiny_script, 2, 20, 8, 0.1, 3)
    assert_close_state(got, want)
    metrics = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = sorted({(m["rank"], m["step"]) for m in metrics if m["kind"] == "metric"})
    assert steps == [(r, s) for r in (0, 1) for s in (5, 10, 15, 20)]
    # one host: every byte is counted, none of them as leaving the host
    assert all(m["bytes_sent"] > 0 and m["bytes_sent_remote"] == 0 for m in metrics if m["kind"] == "metric")
    assert os.path.exists(os.path.join(run_dir, "logs", "worker-1.log"))
    assert json.load(open(os.path.join(run_dir, "config.json")))["world_size"] == 2


@pytest.mark.timeout(180)
def test_allreduce_sparse_matches_and_counts_allgather_bytes(tmp_path, reap_run):
    from conftest import embed_script, write_script

    script = write_script(tmp_path, embed_script(steps=10))
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    res = hpar("run", script, "--gpus", "2", "--strategy", "allreduce-sparse", "--run-dir", run_dir, "--plain")
    assert res.returncode == 0, res.stdout + res.stderr
    assert_close_state(final_state(run_dir), single_process_reference(script, 2, 10, 4, 0.1, 0))
    # expected bytes per step: ring AllReduce of the 9 dense floats, plus an AllGather of this
    # worker's unique embedding rows (int64 index + 8 float32 values each) to 1 peer
    job = load_job(script)
    batches = job.batches(0, 2, 4)
    rows = [len(torch.unique(next(batches)[0])) for _ in range(10)]
    want = sum(9 * 4 + r * (8 + 8 * 4) for r in rows) / 10
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["bytes_per_step"]["sent"] == pytest.approx(want, rel=1e-6)
