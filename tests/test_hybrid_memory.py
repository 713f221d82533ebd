"""A served table is never materialised on a worker, through the real `hpar run`: a model
with a 2 GiB embedding table trains with hybrid on 2 workers and 1 server, evaluates (its
lookups read the served rows on demand) and writes its final model where it lives (the server
its table, the workers the dense layers: RUN_DIR/model, torch.distributed.checkpoint), and
every worker's peak RSS over the whole run (summary.json ``worker_peak_rss_bytes``, getrusage
after the final model is written) stays under 1.5 GiB, where worker 0 used to peak at 2.4 GiB
assembling the table for model.pt."""

from __future__ import annotations

import json
import math
import os

import pytest

from conftest import hpar, run_processes, write_script

ROWS, DIM = 1 << 23, 64  # 2^23 rows x 64 float32 = 2^31 bytes
TABLE_BYTES = ROWS * DIM * 4

BIG_TABLE = f"""
import torch, torch.nn as nn
HPAR = {{"steps": 3, "batch_size": 16, "lr": 0.1}}
class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        # zero-initialised (as from_pretrained of a zero matrix): a normal_ fill of 2^29 values
        # would cost this test ~10 s per process that builds it
        self.items = nn.Embedding.from_pretrained(torch.zeros({ROWS}, {DIM}), freeze=False)
        self.mlp = nn.Sequential(nn.Linear({DIM}, 16), nn.ReLU(), nn.Linear(16, 1))
    def forward(self, ids):
        return self.mlp(self.items(ids).mean(1)).squeeze(1)
def model():
    return Recommender()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randint(0, {ROWS}, (batch_size, 4), generator=g), torch.randn(batch_size, generator=g)
def loss(o, t):
    return ((o - t) ** 2).mean()
def evaluate(model):
    ids = torch.randint(0, {ROWS}, (64, 4), generator=torch.Generator().manual_seed(9))
    return {{"mse": float((model(ids) ** 2).mean())}}
"""


# slow: the launcher's pre-start check and the server build the 2 GiB table once each (the
# user's model() builds it): about a minute on the shared 2-core machine
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_2gib_table_trains_evaluates_and_is_saved_without_ever_being_on_a_worker(tmp_path):
    script = write_script(tmp_path, BIG_TABLE)
    run_dir = str(tmp_path / "run")
    res = hpar(
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "hybrid",
        "--servers",
        "1",
        "--device",
        "cpu",
        "--plain",
        "--run-dir",
        run_dir,
        timeout=280,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    peaks = summary["worker_peak_rss_bytes"]
    assert len(peaks) == 2 and all(p > 0 for p in peaks), peaks
    # each worker holds torch, the dense layers and a few pulled rows; the table alone is 2 GiB
    assert max(peaks) < 1.5e9, f"a worker's peak RSS {max(peaks) / 2**30:.2f} GiB: the table was built there"
    assert summary["steps"] == 3 and math.isfinite(summary["loss_last"]) and math.isfinite(summary["eval_last"]["mse"])
    assert summary["ps_params"] == ["items.weight"]
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(os.path.join(run_dir, "model")).read_metadata().state_dict_metadata
    assert tuple(saved["model.items.weight"].size) == (ROWS, DIM) and "model.mlp.0.weight" in saved
    assert not run_processes(run_dir)


# An evaluate() that reads a served table's weight directly (as examples/lm.py's full softmax
# does), beside one that only looks rows up: both see the table as the servers hold it.
DIRECT_READ = """
import torch, torch.nn as nn
HPAR = {"steps": 4, "batch_size": 8, "lr": 0.1, "eval_every": 2}
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(300, 8)
        self.out = nn.Linear(8, 1)
    def forward(self, ids):
        return self.out(self.emb(ids).mean(1)).squeeze(1)
def model():
    return Net()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        ids = torch.randint(0, 300, (batch_size, 3), generator=g)
        yield ids, ids.float().mean(1) / 300
def loss(o, t):
    return ((o - t) ** 2).mean()
def evaluate(model):
    rows = model.emb(torch.arange(300).unsqueeze(1)).squeeze(1)
    return {"weight_sum": float(model.emb.weight.sum()), "rows_sum": float(rows.sum()),
            "rows": int(model.emb.weight.shape[0])}
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_evaluate_reading_a_served_tables_weight_sees_the_whole_table(tmp_path):
    """A small served table is pulled whole into evaluate()'s copy (hybrid/hybrid_runtime.py
    EVAL_WHOLE_BYTES): its .weight read directly equals its rows looked up, before training,
    mid-run and after, and the final one equals the trained table RUN_DIR/model holds."""
    from conftest import final_state, hpar_to_file, kill_left

    script = write_script(tmp_path, DIRECT_READ)
    run_dir = tmp_path / "run"
    code, out = hpar_to_file(
        tmp_path / "out.txt", "run", script, "--gpus", "2", "--strategy", "hybrid", "--run-dir", str(run_dir), "--plain"
    )
    assert code == 0, out[-3000:]
    assert not kill_left(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = [summary["eval_first"], summary["eval_last"]] + [
        json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"kind": "eval"' in line
    ]
    for e in evals:
        assert e["rows"] == 300 and math.isclose(e["weight_sum"], e["rows_sum"], rel_tol=1e-5, abs_tol=1e-5), e
    assert math.isclose(
        summary["eval_last"]["weight_sum"], float(final_state(run_dir)["emb.weight"].sum()), rel_tol=1e-5, abs_tol=1e-5
    )
