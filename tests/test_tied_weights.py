"""A weight tied under two names (an output layer that is the embedding table) is stored once
in RUN_DIR/model and in `hpar export --format torch|safetensors`, comes back under both names,
and the profile and the plan's reason count it as an embedding table whose gradient is dense
(strategies/state/aliases.py, strategies/plan/planner.py), through the real CLI."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from conftest import final_state, hpar_to_file, kill_left, single_process_reference, write_script

pytestmark = pytest.mark.multiprocess

# layer 4 (the output projection) is layer 0 (the table): 4000 x 32 float32, 512 KB, nearly all
# of the model; a pipeline of stages [0, 2) and [2, 5) holds it on both stages
TIED = """
import torch, torch.nn as nn, torch.nn.functional as F
HPAR = {"steps": 3, "batch_size": 8, "lr": 0.5, "log_every": 1}
VOCAB, DIM, CTX = 4000, 32, 4
class Mean(nn.Module):
    def forward(self, x):
        return x.mean(1)
def model():
    emb, out = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB, bias=False)
    out.weight = emb.weight
    return nn.Sequential(emb, Mean(), nn.Linear(DIM, DIM), nn.Tanh(), out)
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(100 + rank)
    while True:
        ids = torch.randint(0, VOCAB, (batch_size, CTX), generator=g)
        yield ids, (ids[:, 0] + 1) % VOCAB
def loss(output, targets):
    return F.cross_entropy(output, targets)
def optimizer(params):
    return torch.optim.SGD(params, lr=0.5)
"""
TABLE = 4000 * 32 * 4  # the tied weight's bytes
OTHERS = (32 * 32 + 32) * 4  # the rest of the model
NAMES = {"0.weight", "2.weight", "2.bias", "4.weight"}


def _check_model_dir(run_dir) -> None:
    """RUN_DIR/model holds the table once: its keys (the tie recorded, not a second tensor) and
    its files' bytes (one copy, not the two the state_dict lists)."""
    from hpar.strategies.state import state

    keys = state.saved_keys(os.path.join(str(run_dir), "model"))
    assert "model.0.weight" in keys and "model.4.weight" not in keys and "tied.4.weight" in keys, keys
    stored = sum(os.path.getsize(f) for f in glob.glob(os.path.join(str(run_dir), "model", "*.distcp")))
    assert TABLE < stored < TABLE + OTHERS + 64_000 < 2 * TABLE, stored


def _check_exports(tmp_path, script: str, run_dir, want: dict) -> None:
    """`hpar export --format torch` is one copy of the table under both names (one storage) and
    loads strictly into the script's model(); `--format safetensors` is one copy under the first."""
    from safetensors.torch import load_file
    from hpar.strategies.job.contract import load_job

    rc, out = hpar_to_file(
        tmp_path / "e1.txt", "export", str(run_dir), "--format", "torch", "--out", str(tmp_path / "m.pt")
    )
    assert rc == 0, out
    assert TABLE < os.path.getsize(tmp_path / "m.pt") < TABLE + OTHERS + 16_000, os.path.getsize(tmp_path / "m.pt")
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert set(got) == NAMES and got["4.weight"].data_ptr() == got["0.weight"].data_ptr()
    model = load_job(script).build_model()
    model.load_state_dict(got)  # strict
    assert model[4].weight is model[0].weight
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-4, atol=1e-5, msg=k)
    rc, out = hpar_to_file(
        tmp_path / "e2.txt", "export", str(run_dir), "--format", "safetensors", "--out", str(tmp_path / "st")
    )
    assert rc == 0, out
    size = os.path.getsize(tmp_path / "st" / "model.safetensors")
    assert TABLE < size < TABLE + OTHERS + 16_000, size
    st = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert set(st) == NAMES - {"4.weight"}
    fresh = load_job(script).build_model()
    assert fresh.load_state_dict(st, strict=False).missing_keys == ["4.weight"]
    assert torch.equal(fresh[4].weight, got["4.weight"])


@pytest.mark.parametrize("strategy", ["allreduce", "pipeline"])
def test_a_tied_weight_is_stored_once_in_the_model_and_its_exports(tmp_path, strategy):
    """allreduce on 2 workers, and a 2-stage pipeline whose stages both hold the tied weight
    (each writes it): one copy in RUN_DIR/model and in each export, equal to one process's
    training (the reads give the later name back as the same tensor)."""
    script = write_script(tmp_path, TIED)
    run_dir = tmp_path / "run"
    flags = ["--strategy", "allreduce"]
    if strategy == "pipeline":
        plan = tmp_path / "plan.json"
        plan.write_text(json.dumps({"strategy": "pipeline", "stages": [[0, 2], [2, 5]], "micro_batches": 2}))
        flags = ["--plan", str(plan), "--schedule", "1f1b"]
    rc, out = hpar_to_file(
        tmp_path / "out.txt", "run", script, "--gpus", "2", *flags, "--run-dir", str(run_dir), "--plain", "--no-eval"
    )
    assert rc == 0 and not kill_left(run_dir), out[-3000:]
    _check_model_dir(run_dir)
    want = single_process_reference(script, 2 if strategy == "allreduce" else 1, 3, 8, 0.5)
    saved = final_state(run_dir)
    assert set(saved) == NAMES and saved["4.weight"] is saved["0.weight"]
    _check_exports(tmp_path, script, run_dir, want)


def test_profile_and_plan_name_the_tied_table_as_an_embedding_table_with_a_dense_gradient(tmp_path):
    """`hpar profile --json`: the table is not sparse, ``tied_to`` names the output layer, and the
    plan's reason counts it among the embedding tables (not "0% of the bytes in embedding
    tables"), with the tie as why its gradient is dense; a profile without ``tied_to`` (written
    before it existed) still reads."""
    from hpar.strategies.profile.records import Profile

    script = write_script(tmp_path, TIED)
    rc, out = hpar_to_file(
        tmp_path / "out.txt", "profile", script, "--gpus", "2", "--bandwidth", "100Gbps", "--latency", "1us", "--json"
    )
    assert rc == 0, out[-3000:]
    report = json.loads(out[out.index("{") :])
    table = next(p for p in report["parameters"] if p["name"] == "0.weight")
    assert table["tied_to"] == ["4.weight"] and not table["sparse"] and not table["embedding_module"], table
    assert all(p["tied_to"] == [] for p in report["parameters"] if p["name"] != "0.weight")
    plan = report["plan"]
    assert plan["strategy"] == "allreduce", plan
    share = TABLE / (TABLE + OTHERS)
    assert plan["reason"].startswith(
        f"allreduce: the gradients are dense: {share:.0%} of the bytes are in embedding tables, all tied to a dense "
        "layer (0.weight tied to 4.weight), so their gradients are dense, and AllReduce of "
    ), plan["reason"]
    hybrid = next(c for c in report["candidates"] if c["strategy"] == "hybrid")
    assert "0.weight tied to 4.weight, so its gradient is dense (same as allreduce)" in hybrid["note"], hybrid
    old = {
        "params": [
            {
                "name": "w",
                "shape": [2],
                "bytes": 8,
                "sparse": False,
                "alpha": 1.0,
                "union_alpha": 1.0,
                "embedding_module": False,
            }
        ],
        "layers": [],
        "batch_size": 1,
        "samples_per_batch": 1,
        "workers": 1,
        "is_sequential": False,
        "sequential_reason": "",
        "compute_s": 0.0,
        "forward_s": 0.0,
        "backward_s": 0.0,
        "forward_flops": 0,
        "backward_flops": 0,
        "update_s_per_byte": 0.0,
        "timing_batch_size": 1,
    }
    assert Profile.from_dict(old).params[0].tied_to == ()
    # GPT-2: a tied token table and a small row-sparse position table
    from hpar.strategies.plan import plan_reasons

    mixed = Profile.from_dict(
        {
            **old,
            "params": [
                {**old["params"][0], "name": "wte.weight", "bytes": 750, "tied_to": ["lm_head.weight"]},
                {**old["params"][0], "name": "wpe.weight", "bytes": 3, "sparse": True, "embedding_module": True},
                {**old["params"][0], "name": "h.weight", "bytes": 247},
            ],
        }
    )
    assert plan_reasons.dense_why(0.003, mixed) == (
        "the gradients are mostly dense: 75% of the bytes are in embedding tables, 0.3% in row-sparse ones; the "
        "others are tied to a dense layer (wte.weight tied to lm_head.weight), so their gradients are dense"
    )
