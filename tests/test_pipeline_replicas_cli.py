"""`hpar run --strategy pipeline --gpus 4` as 2 stages x 2 replicas through the real launcher
(stdout to a file): the plan line, exit code, the trained model against one process on the
concatenated batch, nothing left behind; and the one-line refusals of --pipeline-replicas."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hpar.strategies.specs.decision import Plan

from conftest import TINY, run_processes, single_process_reference, write_script, final_state

pytestmark = [pytest.mark.multiprocess]


def hpar_to_file(tmp_path, *args, timeout=240):
    """Run the real CLI with stdout and stderr to files; returns (exit code, stdout, stderr)."""
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as fo, open(err, "w") as fe:
        code = subprocess.run(
            [sys.executable, "-m", "hpar.launcher.cli", *args], stdout=fo, stderr=fe, timeout=timeout
        ).returncode
    return code, out.read_text(), err.read_text()


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("pipedp")
    script = write_script(tmp_path, TINY)
    run_dir = str(tmp_path / "run")
    code, out, err = hpar_to_file(
        tmp_path,
        "run",
        script,
        "--gpus",
        "4",
        "--strategy",
        "pipeline",
        "--pipeline-replicas",
        "2",
        "--steps",
        "6",
        "--batch-size",
        "8",
        "--lr",
        "0.1",
        "--run-dir",
        run_dir,
        "--plain",
    )
    return script, run_dir, code, out, err


@pytest.mark.timeout(300)
def test_pipeline_two_stages_by_two_replicas_through_the_launcher(two_by_two):
    script, run_dir, code, out, err = two_by_two
    assert code == 0, out + err
    assert not run_processes(run_dir)
    line = next(l for l in out.splitlines() if l.startswith("hpar: pipeline plan:"))
    assert "2 stages x 2 replicas (rank = r*K + k" in line or "2 stages x 2 replicas (rank = k*R + r" in line, line
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert (summary["pipeline_stages"], summary["pipeline_replicas"], summary["world_size"]) == (2, 2, 4)
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert config["replicas"] == 2 and config["plan"]["replicas"] == 2 and len(config["plan"]["stages"]) == 2
    ref = single_process_reference(script, world_size=2, steps=6, batch_size=8, lr=0.1)
    state = final_state(run_dir)
    for k in ref:
        assert torch.allclose(state[k], ref[k], rtol=1e-5, atol=1e-6), k
    # the reported loss of the last step: the mean over both replicas = the loss of the concatenated batch
    ref5 = single_process_reference(script, world_size=2, steps=5, batch_size=8, lr=0.1)
    from hpar.strategies.job.contract import load_job

    job = load_job(script)
    model = job.build_model()
    model.load_state_dict(ref5)
    streams = [job.batches(r, 2, 8) for r in range(2)]
    for _ in range(6):
        pairs = [next(s) for s in streams]
    with torch.no_grad():
        last = float(job.compute_loss(model(torch.cat([p[0] for p in pairs])), torch.cat([p[1] for p in pairs])))
    assert summary["loss_last"] == pytest.approx(last, rel=1e-5)
    assert summary["eval_last"]["mse"] < summary["eval_first"]["mse"]


@pytest.mark.timeout(120)
def test_more_stages_than_layers_is_one_line_and_exit_2(tmp_path):
    """The `hpar run` command in this process (click's runner: no interpreter start), refused
    before the planner profiles anything."""
    from click.testing import CliRunner
    from hpar.launcher.cli import main

    script = write_script(tmp_path, TINY)
    run_dir = tmp_path / "run"
    res = CliRunner().invoke(
        main,
        [
            "run",
            script,
            "--strategy",
            "pipeline",
            "--gpus",
            "8",
            "--pipeline-replicas",
            "1",
            "--run-dir",
            str(run_dir),
            "--plain",
        ],
    )
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and "--pipeline-replicas 1: --gpus 8 / 1 = 8 stages, but the model has only 5 layers" in lines[0]
    ), res.stderr
    assert not run_dir.exists() and not run_processes(str(run_dir))


def test_replicas_flag_checks_before_planning(tmp_path):
    from hpar.strategies.plan.pipeline_grid import check_replicas_flag, plan_replicas, planner_replicas
    from hpar.strategies.job.contract import load_job

    model = load_job(write_script(tmp_path, TINY)).build_model()
    with pytest.raises(
        ValueError,
        match="--pipeline-replicas 3: a pipeline plan is K stages x R replicas = --gpus 4; choose a divisor of 4",
    ):
        check_replicas_flag(3, 4, "pipeline", model)
    with pytest.raises(ValueError, match="--pipeline-replicas 2 applies to --strategy pipeline only, not allreduce"):
        check_replicas_flag(2, 4, "allreduce", model)
    assert (
        check_replicas_flag(2, 4, "auto", model) == "pipeline" and check_replicas_flag(None, 4, "auto", model) == "auto"
    )
    with pytest.raises(ValueError, match="--pipeline-replicas 1 contradicts plan.json .2 replicas"):
        plan_replicas(Plan(replicas=2), 1, "plan.json")
    assert plan_replicas(Plan(), None, "plan.json") == 1
    assert planner_replicas(None, "torch-1f1b") == 1 and planner_replicas(None, "1f1b") is None


def test_plan_line_names_stages_replicas_and_layout():
    from hpar.strategies.plan.pipeline_grid import describe_plan
    from hpar.strategies.job.config import RunConfig

    args = dict(script="j.py", strategy="pipeline", steps=1, batch_size=8, lr=0.1, seed=0, run_dir="r")
    cfg = RunConfig(
        **args,
        world_size=4,
        replicas=2,
        micro_batches=1,
        plan={"stages": [[0, 4], [4, 5]], "replicas": 2, "layout": "replicas-adjacent"},
    )
    assert describe_plan(cfg) == (
        "hpar: pipeline plan: 2 stages x 2 replicas (rank = k*R + r, replicas-adjacent), "
        "layers [0, 4), [4, 5), 1 micro-batch per replica, schedule 1f1b"
    )
    assert (
        describe_plan(RunConfig(**args, world_size=2, micro_batches=4))
        == "hpar: pipeline plan: 2 stages, layers balanced on parameter counts, 4 micro-batches, schedule 1f1b"
    )
