"""Rows requested before the lookup that needs them: a sampled softmax's output table, whose
candidates hold the batch's target words, gets the targets' rows with the step's first pulls
and pulls only the sampled rows at lookup (strategies/runtimes/hybrid/ahead.py)."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from hpar.strategies.runtimes.hybrid import ahead, embedding
from hpar.strategies.specs.decision import Plan

from conftest import write_script, final_state
from test_training_loop import close, reference, run_cli

# Context words -> hidden; the output table and its bias score each sample's target word
# (positive) and three fixed negatives with a per-sample logistic loss, looked up together
# as one unique candidate set, as a sampled softmax does. Per-sample losses keep N workers
# equal to one process on the concatenated batch (a softmax over the shared candidates would
# not).
SAMPLED = """
import torch, torch.nn as nn, torch.nn.functional as F
HPAR = {"steps": 10, "batch_size": 4, "lr": 0.1, "log_every": 5}
NEGATIVES = torch.tensor([0, 7, 31])
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(60, 8)
        self.proj = nn.Linear(8, 8)
        self.out = nn.Embedding(60, 8)
        self.bias = nn.Embedding(60, 1)
    def forward(self, batch):
        words, targets = batch
        h = self.proj(self.emb(words).mean(1))
        cand, inv = torch.unique(torch.cat([targets, NEGATIVES.to(targets.device)]), return_inverse=True)
        w, b = self.out(cand), self.bias(cand).squeeze(1)
        n = targets.numel()
        return (h * w[inv[:n]]).sum(1) + b[inv[:n]], h @ w[inv[n:]].t() + b[inv[n:]]
def model(): return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        words = torch.randint(1, 60, (batch_size, 3), generator=g)
        yield (words, (words.sum(1) * 7) % 59 + 1), torch.zeros(batch_size)
def loss(o, t):
    pos, neg = o
    return F.softplus(-pos).mean() + F.softplus(neg).mean()
def optimizer(params): return torch.optim.Adagrad(params, lr=0.1)
"""


class Client:
    """Answers pulls with rows whose values are their ids; records what was asked."""

    def __init__(self):
        self.pulls = []

    def pull_async(self, table, ids, step):
        self.pulls.append((table.name, ids.tolist(), step))
        return lambda: ids.float().unsqueeze(1).expand(ids.numel(), table.dim).clone()


def test_the_covering_batch_tensor_is_the_largest_whose_ids_were_all_looked_up():
    looked_up = torch.tensor([0, 2, 3, 5, 7, 9])
    leaves = {
        "/0": torch.tensor([[2, 3], [3, 11]]),  # 11 was not looked up
        "/1": torch.tensor([3, 5, 5]),
        "/2": torch.tensor([9, 2, 7, 5]),
        "/3": torch.tensor([-1, 2]),
    }
    assert ahead.covering_leaf(looked_up, leaves, rows=12) == "/2"
    assert ahead.covering_leaf(looked_up, leaves, rows=9) == "/1"  # /2 holds row 9 of a 9-row table
    assert ahead.covering_leaf(torch.tensor([1, 4]), leaves, rows=12) is None


def test_rows_requested_ahead_are_used_and_only_the_others_pulled():
    """The lookup's rows are the answer's where it has them and a pull of the rest; an answer
    covering every row sends nothing; without an answer everything is pulled."""
    table = SimpleNamespace(name="out", rows=60, dim=2)
    item = embedding.ServedEmbedding(None, table)
    client = Client()
    targets = torch.tensor([4, 9, 4, 20])
    have = torch.tensor([4, 9, 20])
    pre = (targets, have, None, lambda: have.float().unsqueeze(1).expand(3, 2).clone())
    uids = torch.tensor([0, 4, 7, 9, 20, 31])
    rows = ahead.complete(client, item, uids, pre, step=3)()
    assert client.pulls == [("out", [0, 7, 31], 3)]
    assert torch.equal(rows, uids.float().unsqueeze(1).expand(6, 2))
    rows = ahead.complete(client, item, torch.tensor([9, 20]), pre, step=4)()
    assert client.pulls[-1] == ("out", [], 4) and torch.equal(rows[:, 0], torch.tensor([9.0, 20.0]))
    ahead.complete(client, item, uids, None, step=5)()
    assert client.pulls[-1] == ("out", uids.tolist(), 5)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_sampled_output_table_gets_its_targets_rows_ahead_and_trains_the_same_model(tmp_path):
    """`hpar run --strategy hybrid` on the sampled model above: the output table and its bias
    (looked up with the unique candidates, not a batch tensor) get the targets' rows with the
    step's first pulls, and the model and every table's
    bytes equal a run with the pull-ahead turned off (which still asks for the targets' rows
    before the forward) and one process on the concatenated batches."""
    script = write_script(tmp_path, SAMPLED)
    code, run_dir, out = run_cli(tmp_path, script, "--gpus", "2", "--strategy", "hybrid", "--no-eval")
    assert code == 0, out
    want, _ = reference(script, 2, 10, 4, 0.1)
    close(final_state(run_dir), want)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    # rank 0 asked a step ahead for the words' rows of steps 1-9 only: the targets' rows go
    # with the step's first pulls, before its forward, not a step ahead
    assert summary["pulls_ahead"] == 9
    plan = tmp_path / "plan.json"
    plan.write_text(
        Plan(
            strategy="hybrid",
            placement={},
            partitions={},
            servers=1,
            stages=[],
            micro_batches=1,
            schedule="1f1b",
            reason="",
            candidates=[],
            pull_ahead=False,
        ).to_json()
    )
    code, off_dir, out = run_cli(
        tmp_path, script, "--gpus", "2", "--strategy", "hybrid", "--plan", str(plan), "--no-eval", name="off"
    )
    assert code == 0, out
    off = json.load(open(os.path.join(off_dir, "summary.json")))
    close(final_state(off_dir), want)
    assert off["pulls_ahead"] == 0 and off["by_param"] == summary["by_param"]
