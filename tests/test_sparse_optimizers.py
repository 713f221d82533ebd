"""Sparse gradients only where the optimizer takes them (strategies/job/optimizer_rules.py): the rule,
allreduce-sparse with AdamW (its gathered rows made dense to step) equal to allreduce through
the real `hpar run`, and the strategies whose parameter servers cannot apply an optimizer
refused by the planner and before `hpar run` starts anything."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from conftest import REPO, hpar_to_file, run_processes, write_script, final_state
from hpar.strategies.job.optimizer_rules import densify, takes_sparse_gradients

ZOO = os.path.join(REPO, "tests", "zoo")


def _takes(opt_cls, **options) -> bool:
    p = torch.nn.Parameter(torch.zeros(3, 2))
    return takes_sparse_gradients(opt_cls([p], **options), p)


class MySGD(torch.optim.SGD):  # a user's class: its step may do anything
    pass


def test_which_optimizers_take_sparse_gradients():
    assert _takes(torch.optim.SGD, lr=0.1) and _takes(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True)
    assert _takes(torch.optim.Adagrad) and _takes(torch.optim.SparseAdam)
    assert not _takes(torch.optim.SGD, lr=0.1, weight_decay=1e-4)  # torch: add(sparse, dense) is not supported
    assert not _takes(torch.optim.Adagrad, weight_decay=1e-4)
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adamax, MySGD):
        assert not _takes(cls), cls
    table, other = torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [table], "weight_decay": 0.1}, {"params": [other]}], lr=0.1)
    assert not takes_sparse_gradients(opt, table) and takes_sparse_gradients(
        opt, other
    )  # the table's own group decides
    assert not takes_sparse_gradients(opt, torch.nn.Parameter(torch.zeros(1)))  # in no group


def test_densify_sums_the_gathered_rows():
    p = torch.nn.Parameter(torch.zeros(4, 2))
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3, 1]]), torch.tensor([[1.0, 2], [3, 4], [5, 6]]), (4, 2))
    densify([p])
    assert not p.grad.is_sparse
    assert torch.equal(p.grad, torch.tensor([[0.0, 0], [6, 8], [0, 0], [3, 4]]))


def test_cost_model_prices_the_dense_step_and_refuses_servers_that_cannot_apply_the_optimizer():
    from hpar.strategies.plan.cluster import ClusterSpec
    from hpar.strategies.plan.costmodel import estimate_allreduce_sparse
    from hpar.strategies.plan.costmodel_ps import estimate_hybrid, estimate_ps
    from hpar.strategies.profile.profiler import ParamProfile, Profile

    emb = ParamProfile("emb.weight", (1000, 16), 64_000, True, 0.01, 0.02, True, layer=0)
    lin = ParamProfile("lin.weight", (16, 16), 1024, False, 1.0, 1.0, False, layer=1)
    prof = Profile(
        params=(emb, lin),
        layers=(),
        batch_size=8,
        samples_per_batch=8,
        workers=2,
        is_sequential=False,
        sequential_reason="",
        compute_s=0.01,
        forward_s=0.004,
        backward_s=0.006,
        forward_flops=1,
        backward_flops=2,
        update_s_per_byte=1e-9,
        timing_batch_size=8,
        sparse_update_s_per_byte=None,
        sparse_gradients_ok=False,
    )
    cluster = ClusterSpec(1, (2,), 1, 1e9, 1e-5)
    est = estimate_allreduce_sparse(prof, cluster)
    assert est.feasible and "made dense to step" in est.note
    assert est.breakdown["update"] == pytest.approx((64_000 + 1024) * 1e-9)  # every table row stepped, as dense
    assert estimate_hybrid(prof, cluster).feasible and estimate_ps(prof, cluster).feasible
    refused = dataclasses.replace(prof, server_optimizer_note="optimizer(): RMSprop cannot run on the parameter server")
    for est in (estimate_hybrid(refused, cluster), estimate_ps(refused, cluster)):
        assert not est.feasible and "RMSprop" in est.note


def test_profile_says_what_the_optimizer_takes(tmp_path):
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.profile.profiler import profile_job

    text = open(os.path.join(ZOO, "tied_lm.py")).read()
    rms = load_job(
        write_script(tmp_path, text + "\ndef optimizer(params):\n    return torch.optim.RMSprop(params, lr=0.01)\n")
    )
    prof = profile_job(rms, 8, 2, repeats=1, warmup=1)
    assert not prof.sparse_gradients_ok and "RMSprop cannot run on the parameter server" in prof.server_optimizer_note
    sgd = profile_job(load_job(os.path.join(ZOO, "tied_lm.py")), 8, 2, repeats=1, warmup=1)
    assert sgd.sparse_gradients_ok and sgd.server_optimizer_note == ""


@pytest.mark.parametrize("strategy", ["hybrid", "ps"])
def test_servers_that_cannot_apply_the_optimizer_are_refused_before_start(tmp_path, strategy):
    text = open(os.path.join(ZOO, "tied_lm.py")).read()
    script = write_script(
        tmp_path, text + "\ndef optimizer(params):\n    return torch.optim.RMSprop(params, lr=0.01)\n"
    )
    run_dir = tmp_path / "run"
    rc, out = hpar_to_file(
        tmp_path / "out.txt", "run", script, "--gpus", "2", "--strategy", strategy, "--run-dir", str(run_dir)
    )
    assert rc == 2, out
    assert out.strip().splitlines() == [
        f"hpar: {script}: --strategy {strategy}: optimizer(): RMSprop cannot run on the "
        "parameter server; use SGD (with momentum), Adagrad, Adam or AdamW, or "
        "--strategy allreduce"
    ], out
    assert not run_dir.exists() and not run_processes(str(run_dir))


def _step_losses(run_dir) -> dict:
    """{(rank, step): loss} of a run logged every step."""
    out = {}
    for line in open(run_dir / "metrics.jsonl"):
        m = json.loads(line)
        if m.get("kind") == "metric" and m.get("role") == "worker":
            out[(m["rank"], m["step"])] = m["loss"]
    return out


def test_allreduce_sparse_with_adamw_equals_allreduce(tmp_path, reap_run):
    """Hugging Face's GPT-2 with AdamW (tests/zoo/hf_gpt2.py): allreduce-sparse exchanges the
    position table's rows sparse and makes them dense to step, so its 10 steps' losses (each
    worker's, every step) and its trained weights equal allreduce's; before, every worker
    raised torch's "Adam does not support sparse gradients" at the first step."""
    pytest.importorskip("transformers", reason="tests/zoo/hf_gpt2.py builds its model with transformers")
    runs = {}
    for strategy in ("allreduce", "allreduce-sparse"):
        run_dir = tmp_path / strategy
        reap_run(str(run_dir))
        rc, out = hpar_to_file(
            tmp_path / f"{strategy}.txt",
            "run",
            os.path.join(ZOO, "hf_gpt2.py"),
            "--gpus",
            "2",
            "--strategy",
            strategy,
            "--log-every",
            "1",
            "--run-dir",
            str(run_dir),
            "--no-eval",
            cwd=str(tmp_path),
        )
        assert rc == 0, out[-3000:]
        runs[strategy] = (run_dir, out)
    (dense_dir, _), (sparse_dir, out) = runs["allreduce"], runs["allreduce-sparse"]
    assert "hpar: AdamW takes no sparse gradients: transformer.wpe.weight exchanged sparse" in out, out[-3000:]
    assert json.loads((sparse_dir / "summary.json").read_text())["strategy"] == "allreduce-sparse"
    dense, sparse = _step_losses(dense_dir), _step_losses(sparse_dir)
    assert len(dense) == 20 and dense.keys() == sparse.keys()
    for key in dense:
        assert sparse[key] == pytest.approx(dense[key], rel=1e-5), key
    a, b = final_state(dense_dir), final_state(sparse_dir)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    sent = [json.loads((d / "summary.json").read_text())["bytes_per_step"]["sent"] for d in (dense_dir, sparse_dir)]
    assert sent[1] < sent[0], sent  # the position table's touched rows only
