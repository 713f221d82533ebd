"""``--strategy fsdp`` (strategies/runtimes/dataparallel/fsdp.py, torch's FSDP2) through the real ``hpar run``: exact
against one process on the concatenated batches with the training loop's features, checkpoints
with torch.distributed.checkpoint that resume (also at another size), and the unit choice."""

import json
import os

import pytest
from torch import nn

from hpar.strategies.runtimes.dataparallel.fsdp import units

from conftest import final_state, write_script
from test_training_loop import LOOP, close, reference, run_cli, worker0_losses


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("workers, extra", [(2, ("--accumulate", "2", "--eval-every", "5")), (4, ())])
def test_fsdp_equals_one_process_with_a_schedule_and_clipping(tmp_path, workers, extra):
    """N workers (FSDP2 on gloo, gradients reduced as a sum over N: pytorch#162338) with the
    script's warm-up schedule and --clip-grad-norm equal one process on the N concatenated
    batches after 20 steps, every weight within 1e-5 (2 workers also with --accumulate 2,
    --eval-every and log()); nothing is left running."""
    script = write_script(tmp_path, LOOP)
    code, run_dir, out = run_cli(
        tmp_path, script, "--gpus", str(workers), "--strategy", "fsdp", "--seed", "3", "--clip-grad-norm", "0.5", *extra
    )
    assert code == 0, out
    accumulate = 2 if "--accumulate" in extra else 1
    want, losses = reference(script, workers, 20, 8, 0.1, seed=3, accumulate=accumulate, clip=0.5)
    close(final_state(run_dir), want)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["strategy"] == "fsdp" and summary["loss_last"] == pytest.approx(losses[-1], rel=1e-5)
    assert summary["fsdp_units"] == 3  # Block, Linear, Linear: the model's layers with weights
    assert summary["peak_bytes"]["worker"] > 0 and summary["predicted_peak_bytes"]["worker"] > 0
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    w0 = [m for m in rows if m["kind"] == "metric" and m["rank"] == 0]
    assert [round(m["lr"], 6) for m in w0] == [0.1, 0.1, 0.05, 0.05]  # the schedule: warm-up, then halved
    if extra:
        assert [m["step"] for m in rows if m["kind"] == "eval"] == [5, 10, 15]
        assert all("abs_err" in m["logged"] for m in w0)
        assert set(worker0_losses(run_dir)) == {5, 10, 15, 20}


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_fsdp_checkpoints_resume_like_an_uninterrupted_run(tmp_path):
    """A 2-worker run checkpointed at step 10 (each rank's shards with torch.distributed.checkpoint,
    every file checksummed, the loop state beside them) and resumed to 20 equals one
    process trained 20 steps on the concatenated batches: the schedule's and the momentum's
    state came back."""
    script = write_script(tmp_path, LOOP)
    code, part, out = run_cli(
        tmp_path,
        script,
        "--gpus",
        "2",
        "--strategy",
        "fsdp",
        "--seed",
        "3",
        "--no-eval",
        "--steps",
        "10",
        "--checkpoint-every",
        "5",
        name="part",
    )
    assert code == 0, out
    step10 = os.path.join(part, "checkpoints", "step-10")
    assert sorted(os.listdir(step10)) == [
        ".metadata",
        ".metadata.sha256",
        "__0_0.distcp",
        "__0_0.distcp.sha256",
        "__1_0.distcp",
        "__1_0.distcp.sha256",
    ]  # each rank its own shards
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(step10).read_metadata().state_dict_metadata
    weight = next(k for k in saved if k.startswith("model.") and k.endswith("weight"))
    assert len(saved[weight].chunks) == 2, "a weight written as two shards, not gathered"
    assert any(k.startswith("optim.") for k in saved) and any(k.startswith("loop.workers") for k in saved)
    code, out = _resume(tmp_path, part)
    assert code == 0, out
    want, _ = reference(script, 2, 20, 8, 0.1, seed=3)
    close(final_state(part), want)


def _resume(tmp_path, run_dir):
    from conftest import hpar_to_file, kill_left

    code, out = hpar_to_file(tmp_path / "resume.out", "run", "--resume", run_dir, "--steps", "20", "--no-eval")
    assert not kill_left(run_dir), "processes left behind"
    return code, out


def test_fsdp_refuses_fp16_in_one_line(tmp_path):
    from conftest import hpar

    script = write_script(tmp_path, LOOP)
    r = hpar(
        "run", script, "--gpus", "2", "--strategy", "fsdp", "--precision", "fp16", "--run-dir", str(tmp_path / "run")
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "hpar: --precision fp16 is not supported with --strategy fsdp (its gradient scaler's inf/NaN check would "
        "span the shards); use --precision bf16"
    ]


def test_units_are_the_layers_with_weights_and_a_tied_weight_stays_with_the_root():
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10)
    head.weight = emb.weight
    model = nn.Sequential(emb, nn.Linear(4, 4), nn.ReLU(), head)
    assert units(model) == [model[1]]  # the tied pair is the root's; the ReLU holds nothing

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    net = Blocks()
    assert units(net) == list(net.blocks)  # a model that is not a sequence: its repeated blocks
