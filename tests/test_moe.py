"""A mixture of experts whose ranks leave different experts unused (tests/zoo/moe.py) through the
real CLI: the profile draws several ranks' batches and reports it (strategies/profile/unused.py),
DDP's strategies get find_unused_parameters, fsdp is refused in one line (FSDP2 reduce-scatters
only the gradients a rank has), and routing that leaves an expert unused only after the probed
steps restarts the run with the setting on (launcher/run/runner.py). Every run that trains
equals one process on the concatenated batches, with no traceback and no process left."""

from __future__ import annotations

import json
import os

import pytest

from conftest import REPO, final_state, hpar_to_file, single_process_reference, write_script
from test_allreduce import assert_close_state

pytestmark = [pytest.mark.multiprocess]

MOE = os.path.join(REPO, "tests", "zoo", "moe.py")
STEPS, BATCH, LR = 10, 8, 0.1  # moe.py's HPAR
EXPERT = "experts.0.0.weight"


def _trained(out: str, code: int, run_dir: str, script: str = MOE) -> None:
    assert code == 0, out
    assert "Traceback" not in out and "Error" not in out, out  # no worker's traceback, no gloo error
    assert_close_state(final_state(run_dir), single_process_reference(script, 2, STEPS, BATCH, LR))


def test_probe_draws_several_ranks_batches():
    """Worker 0's batches alone reach every expert; worker 1's leave two out, a different two
    each step. A branch every rank skips in the same step is no difference between ranks."""
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.profile.unused import probe_unused

    job = load_job(MOE)
    assert probe_unused(job, BATCH, 1) == probe_unused(job, BATCH, 1, budget_s=0.0)
    assert probe_unused(job, BATCH, 1).params == ()
    seen = probe_unused(job, BATCH, 2)
    assert seen.by_rank and EXPERT in seen.params and "head.weight" not in seen.params
    branch = probe_unused(load_job(os.path.join(REPO, "tests", "zoo", "sometimes_unused.py")), 8, 2)
    assert branch.params == ("extra.bias", "extra.weight") and not branch.by_rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["allreduce-sparse", "hybrid", "auto"])
def test_moe_trains_equal_to_one_process(strategy, tmp_path, reap_run):
    """Worker 0's batches reach every expert, worker 1's two of them: the probe (or the profile,
    under auto) draws both ranks' batches, so DDP looks for unused parameters every step."""
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    code, out = hpar_to_file(
        tmp_path / "out.txt", "run", MOE, "--gpus", "2", "--strategy", strategy, "--run-dir", run_dir, "--plain"
    )
    _trained(out, code, run_dir)
    assert "DDP looks for unused parameters every step" in out
    assert json.load(open(os.path.join(run_dir, "config.json")))["find_unused_parameters"] is True


@pytest.mark.timeout(120)
def test_fsdp_is_refused_in_one_line(tmp_path, reap_run):
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    code, out = hpar_to_file(
        tmp_path / "out.txt", "run", MOE, "--gpus", "2", "--strategy", "fsdp", "--run-dir", run_dir, "--plain"
    )
    assert code == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and "--strategy fsdp" in lines[0] and "without a gradient" in lines[0], out
    assert not os.path.exists(os.path.join(run_dir, "config.json"))


@pytest.mark.timeout(120)
def test_profile_reports_experts_unused_by_rank(tmp_path):
    code, out = hpar_to_file(tmp_path / "out.json", "profile", MOE, "--gpus", "2", "--json")
    assert code == 0, out
    report = json.loads(out[out.index("{") :])
    assert report["profile"]["unused_by_rank"] is True and EXPERT in report["profile"]["unused_params"]
    assert EXPERT in report["plan"]["unused_params"]
    fsdp = next(c for c in report["candidates"] if c["strategy"] == "fsdp")
    assert not fsdp["available"] and "without a gradient" in fsdp["note"]
    assert report["plan"]["strategy"] != "fsdp"


@pytest.mark.timeout(300)
def test_routing_unseen_in_the_probe_restarts_with_the_setting_on(tmp_path, reap_run):
    """Every rank reaches every expert in the first 5 steps (past the probe's), so hpar leaves
    find_unused_parameters off; step 6 leaves experts unused on worker 1: DDP's error is caught,
    and the run restarts from its step-4 checkpoint with the setting on, said in one line."""
    with open(MOE) as f:
        text = f.read()
    assert "ALL_EXPERTS_UNTIL = 0 " in text
    script = write_script(tmp_path, text.replace("ALL_EXPERTS_UNTIL = 0 ", "ALL_EXPERTS_UNTIL = 5 "), "late_moe.py")
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    code, out = hpar_to_file(
        tmp_path / "out.txt",
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "hybrid",
        "--checkpoint-every",
        "4",
        "--run-dir",
        run_dir,
        "--plain",
    )
    _trained(out, code, run_dir, script)
    said = [line for line in out.splitlines() if "without a gradient" in line]
    assert len(said) == 1 and "restarting from step 4 with --find-unused-parameters on" in said[0], out
    assert "DDP looks for unused parameters" not in out  # the probe saw every expert used
    assert json.load(open(os.path.join(run_dir, "config.json")))["find_unused_parameters"] is True
