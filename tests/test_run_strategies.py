"""`hpar run` end to end for the non-DDP runtimes, through the real launcher."""

import json
import os

import pytest

from conftest import hpar, final_state
from conftest import single_process_reference
from test_allreduce import assert_close_state

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.timeout(240)
def test_pipeline_1f1b_through_the_launcher(tiny_script, tmp_path, reap_run):
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    res = hpar(
        "run",
        tiny_script,
        "--gpus",
        "2",
        "--strategy",
        "pipeline",
        "--schedule",
        "1f1b",
        "--micro-batches",
        "4",
        "--steps",
        "10",
        "--run-dir",
        run_dir,
        "--plain",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["strategy"] == "pipeline" and summary["schedule"] == "1f1b" and summary["micro_batches"] == 4
    stages = summary["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    assert all(s["compute_s"] > 0 and s["idle_s"] >= 0 and s["bytes_sent"] > 0 for s in stages)
    plan = json.load(open(os.path.join(run_dir, "plan.json")))
    assert [list(s["layers"]) for s in stages] == plan["stages"], "the plan printed is the plan run"
    # synchronous 1F1B = one process on the same batch (mean over equal micro-batches)
    want = single_process_reference(tiny_script, 1, 10, 8, 0.1, 0)
    assert_close_state(final_state(run_dir), want)
    for rank in (0, 1):
        assert os.path.getsize(os.path.join(run_dir, "logs", f"worker-{rank}.log")) > 0
    assert summary["eval_last"]["mse"] < summary["eval_first"]["mse"]


@pytest.mark.timeout(120)
def test_pipeline_refuses_a_model_that_is_not_a_sequence(tmp_path):
    from conftest import embed_script, write_script

    script = write_script(tmp_path, embed_script())
    res = hpar("run", script, "--gpus", "2", "--strategy", "pipeline", "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 2
    line = res.stderr.strip().splitlines()[0]
    # refused before profiling (the model is checked for layers to cut first), naming the ways out
    assert (
        line.startswith("hpar: --strategy pipeline: the model (M) is not a sequence of layers") and "Sequential" in line
    )
    assert "define hpar_layers()" in line and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "run").exists()
