"""`hpar run --strategy pipeline` with the asynchronous schedules through the real launcher
(stdout to a file): async-2bw and async-predict on the deep MLP example, the divergence
guard's report in summary.json, and async-predict's refusal of an optimizer without a rule."""

import json
import os
import subprocess
import sys

import pytest

from conftest import TINY, run_processes, write_script

pytestmark = [pytest.mark.multiprocess]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEP = os.path.join(ROOT, "examples", "deep_mlp.py")


def hpar_to_file(tmp_path, *args, timeout=240):
    """Run the real CLI with stdout and stderr to files; returns (exit code, stdout, stderr)."""
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as fo, open(err, "w") as fe:
        code = subprocess.run(
            [sys.executable, "-m", "hpar.launcher.cli", *args], stdout=fo, stderr=fe, timeout=timeout
        ).returncode
    return code, out.read_text(), err.read_text()


@pytest.mark.timeout(300)
def test_async_2bw_through_the_launcher_equals_the_simulator(tmp_path, reap_run):
    schedule, micro = "async-2bw", 2
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.runtimes.pipeline.divergence import GuardConfig
    from hpar.strategies.runtimes.pipeline.sim import simulate

    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    code, out, err = hpar_to_file(
        tmp_path,
        "run",
        DEEP,
        "--gpus",
        "2",
        "--strategy",
        "pipeline",
        "--schedule",
        schedule,
        "--micro-batches",
        str(micro),
        "--steps",
        "24",
        "--batch-size",
        "12",
        "--lr",
        "0.2",
        "--on-divergence",
        "sync",
        "--run-dir",
        run_dir,
        "--plain",
    )
    assert code == 0, out + err
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["schedule"] == schedule and len(summary["stages"]) == 2
    assert summary["divergence"]["action"] == "sync"
    sim = simulate(
        load_job(DEEP),
        schedule,
        2,
        steps=24,
        batch_size=12,
        micro_batches=micro,
        lr=0.2,
        seed=0,
        guard=GuardConfig("sync"),
    )
    assert summary["divergence"] == sim.divergence
    assert summary["loss_last"] == pytest.approx(sim.losses[-1], rel=1e-6)
    assert summary["eval_last"]["loss"] < summary["eval_first"]["loss"]
    assert all(1 <= s["weight_versions"] <= 2 for s in summary["stages"])
    assert not run_processes(run_dir)


@pytest.mark.timeout(120)
def test_async_predict_refuses_an_optimizer_without_a_rule_before_start(tmp_path):
    script = write_script(
        tmp_path,
        TINY.replace(
            "def optimizer(params):",
            "def optimizer(params):\n    return torch.optim.RMSprop(params)\ndef _unused(params):",
        ),
    )
    run_dir = tmp_path / "run"
    code, out, err = hpar_to_file(
        tmp_path,
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "pipeline",
        "--schedule",
        "async-predict",
        "--run-dir",
        str(run_dir),
        "--plain",
    )
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "RMSprop" in lines[0] and "async-predict has no weight prediction rule" in lines[0], err
    assert "SGD, Adam or AdamW" in lines[0] and not run_dir.exists()
    code, out, err = hpar_to_file(
        tmp_path,
        "run",
        script,
        "--gpus",
        "4",
        "--strategy",
        "pipeline",
        "--schedule",
        "async-2bw",
        "--micro-batches",
        "2",
        "--pipeline-replicas",
        "1",  # 4 stages
        "--run-dir",
        str(run_dir),
        "--plain",
    )
    assert code == 2 and "--micro-batches 2: --schedule async-2bw needs at least --gpus - 1 = 3" in err, out + err
    assert not run_dir.exists()
