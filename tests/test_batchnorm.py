"""BatchNorm through the real CLI (issue 67, item 3) on tests/zoo/batchnorm.py (an MLP with
BatchNorm1d at batch 16): the profile never runs a training-mode forward on one sample (the
pipeline refusal below profiles it at batch 16, as ``hpar profile`` does); the
saved model (RUN_DIR/model) and ``hpar export`` hold worker 0's running statistics, so the export
evaluates as worker 0 did; ``--sync-batchnorm`` makes 2 workers equal one process on the
concatenated batch, running statistics included; what cannot honour it is refused in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import REPO, final_state, hpar_to_file, single_process_reference

SCRIPT = os.path.join(REPO, "tests", "zoo", "batchnorm.py")
STEPS, BATCH, LR = 6, 16, 0.05


def _exported_eval(run_dir, tmp_path) -> float:
    """``hpar export`` of the run as one torch file, loaded into a fresh model and evaluated."""
    from hpar.strategies.job.contract import load_job

    out = tmp_path / "model.pt"
    code, text = hpar_to_file(tmp_path / "export.txt", "export", str(run_dir), "--format", "torch", "--out", str(out))
    assert code == 0, text
    job = load_job(SCRIPT)
    model = job.build_model()
    model.load_state_dict(torch.load(out))
    return job.run_evaluate(model)["eval_loss"]


def _worker0_eval(run_dir) -> float:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)["eval_last"]["eval_loss"]


@pytest.mark.multiprocess
def test_fsdp_model_and_export_evaluate_as_worker_0(tmp_path, reap_run):
    """Without --sync-batchnorm every worker updates its own running statistics: the saved model
    takes worker 0's (DCP's dedup to the lowest rank), so the export evaluates exactly as worker
    0's evaluate() did (before: 0.69122 against 0.70345 on a 2-worker fsdp run)."""
    run_dir = tmp_path / "run"
    reap_run(str(run_dir))
    code, text = hpar_to_file(
        tmp_path / "out.txt", "run", SCRIPT, "--gpus", "2", "--strategy", "fsdp", "--run-dir", str(run_dir), "--plain"
    )
    assert code == 0, text
    assert _exported_eval(run_dir, tmp_path) == pytest.approx(_worker0_eval(run_dir), rel=1e-6)
    ref = single_process_reference(SCRIPT, 2, STEPS, BATCH, LR)  # the unsynchronised statistics differ
    assert not torch.allclose(final_state(run_dir)["1.running_mean"], ref["1.running_mean"], rtol=1e-3)


@pytest.mark.multiprocess
def test_sync_batchnorm_equals_one_process_buffers_included(tmp_path, reap_run):
    """``--sync-batchnorm`` under allreduce (DDP, CPU workers: hpar's gloo SyncBatchNorm): weights
    and running statistics equal one process on the concatenated batch; the export evaluates as
    worker 0 did."""
    run_dir = tmp_path / "run"
    reap_run(str(run_dir))
    code, text = hpar_to_file(
        tmp_path / "out.txt",
        "run",
        SCRIPT,
        "--gpus",
        "2",
        "--strategy",
        "allreduce",
        "--sync-batchnorm",
        "--run-dir",
        str(run_dir),
        "--plain",
    )
    assert code == 0, text
    got, ref = final_state(run_dir), single_process_reference(SCRIPT, 2, STEPS, BATCH, LR)
    assert {k for k in ref if "running" in k} == {"1.running_mean", "1.running_var", "4.running_mean", "4.running_var"}
    for name, want in ref.items():
        torch.testing.assert_close(got[name].to(want.dtype), want, rtol=1e-5, atol=1e-6, msg=name)
    assert _exported_eval(run_dir, tmp_path) == pytest.approx(_worker0_eval(run_dir), rel=1e-6)


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ("--strategy", "pipeline", "--sync-batchnorm"),
            "--sync-batchnorm synchronises BatchNorm over data-parallel workers",
        ),
        (
            ("--strategy", "pipeline", "--micro-batches", "16"),
            "needs at least 2 in training; use --micro-batches 8 or fewer",
        ),
        (
            ("--strategy", "allreduce", "--batch-size", "1"),
            "needs at least 2 samples per batch in training; use --batch-size 2",
        ),
    ],
)
def test_what_cannot_honour_batchnorm_is_refused_in_one_line(tmp_path, reap_run, args, says):
    """--sync-batchnorm with a pipeline (no replicas to synchronise; refused before the script
    loads), micro-batches of one sample for a model with BatchNorm (refused after the profile
    that plans the pipeline, which times steps of 2 samples or more, as `hpar profile` does,
    instead of failing on BatchNorm's one-sample refusal), and a batch of one sample (refused
    with the batch size that works): exit 2, one line, no worker."""
    run_dir = tmp_path / "run"
    reap_run(str(run_dir))
    code, text = hpar_to_file(
        tmp_path / "out.txt", "run", SCRIPT, "--gpus", "2", *args, "--run-dir", str(run_dir), "--plain"
    )
    assert code == 2, text
    assert says.replace(" ", "") in "".join(text.split()), text  # a terminal may wrap the line
    assert text.count("hpar: ") == 1 and "Traceback" not in text and "Expected more than 1 value" not in text
    assert not os.path.exists(run_dir / "logs")


def test_auto_with_sync_batchnorm_chooses_only_what_honours_it():
    """``--strategy auto --sync-batchnorm``: the candidates that cannot honour the flag (ps,
    pipeline) are not runnable, each noting why, so auto never chooses one that hpar run then
    refuses (launcher/run/vet.vetted_plan's ``needs``)."""
    from hpar.launcher.run.cluster_build import build_cluster
    from hpar.strategies.plan.vet import vetted_plan
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.profile.profiler import profile_job
    from hpar.strategies.specs.registry import spec

    job = load_job(SCRIPT)
    cluster = build_cluster(2, None, None, None, None, None, measured_on="cpu")
    profile = profile_job(job, BATCH, 2, repeats=1, warmup=1)
    plain = {c.strategy: c for c in vetted_plan(job, profile, cluster, schedule="1f1b").candidates}
    assert plain["ps"].available and plain["pipeline"].available  # what the flag takes away
    plan = vetted_plan(job, profile, cluster, needs=("sync_batchnorm",), schedule="1f1b")
    by = {c.strategy: c for c in plan.candidates}
    for name in ("ps", "pipeline"):
        assert not by[name].available and by[name].note == f"--sync-batchnorm does not apply to {name}"
    assert spec(plan.strategy).sync_batchnorm
    assert all(spec(c.strategy).sync_batchnorm for c in plan.candidates if c.available)
