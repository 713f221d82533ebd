"""allreduce-sparse on NCCL (issue 13, item 3): the padded AllGather (Horovod's) is exact and
its bytes are counted; run here on gloo by selecting it explicitly in the plan."""

import json
import os

import pytest
import torch

from hpar.strategies.job.contract import load_job
from hpar.strategies.specs.decision import Plan
from hpar.strategies.runtimes.dataparallel.sparse_allgather import padded_allgather_bytes, sparse_exchange

from conftest import embed_script, hpar, run_processes, single_process_reference, write_script, final_state


def test_nccl_gets_the_padded_allgather():
    assert sparse_exchange(Plan(), "nccl") == "allgather-padded"
    assert sparse_exchange(Plan(), "gloo") == "gloo-sparse"
    assert sparse_exchange(Plan(sparse_exchange="allgather-padded"), "gloo") == "allgather-padded"
    with pytest.raises(ValueError, match="cannot run on NCCL"):
        sparse_exchange(Plan(sparse_exchange="gloo-sparse"), "nccl")
    assert padded_allgather_bytes(5, 32, 3) == 2 * (8 + 5 * (8 + 32))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_padded_allgather_matches_single_process_and_counts_bytes(tmp_path, reap_run):
    script = write_script(tmp_path, embed_script(steps=10))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"strategy": "allreduce-sparse", "sparse_exchange": "allgather-padded"}))
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    res = hpar("run", script, "--gpus", "2", "--plan", str(plan), "--run-dir", run_dir, "--plain", timeout=200)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "hpar: devices: localhost: 2 CPU worker(s) (gloo among workers)" in res.stdout
    got = final_state(run_dir)
    want = single_process_reference(script, 2, 10, 4, 0.1, 0)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-7), k
    # per step: ring AllReduce of the 9 dense floats, plus the padded AllGather: each worker's
    # k, then K_max (int64 id + 8 float32 values) rows to the 1 peer
    job = load_job(script)
    per_rank = [job.batches(r, 2, 4) for r in range(2)]
    kmax = [max(len(torch.unique(next(b)[0])) for b in per_rank) for _ in range(10)]
    want_bytes = sum(9 * 4 + 8 + k * (8 + 8 * 4) for k in kmax) / 10
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["bytes_per_step"]["sent"] == pytest.approx(want_bytes, rel=1e-6)
    assert not run_processes(run_dir)
