"""Resume at another size (launcher/run/reshape.py, strategies/state/state.py): `hpar run --resume
RUN_DIR` with another --gpus, --servers or pipeline shape reads every process's state in its
new layout from the run's torch.distributed.checkpoint (tables re-partitioned over the new
servers, stages re-cut), and continues as a run of the new shape would from that state: one
process trained on the old shape's batches up to the checkpoint, then on the new shape's
(concatenated) batches, with the same optimizer (Adam: its state crosses the resume), equals
the resumed run within float tolerance. Through the real CLI, stdout to a file, no process
left.
"""

from __future__ import annotations

import pytest
import torch

from conftest import _concat, hpar_to_file, kill_left, write_script
from hpar.strategies.job.forward import call_model
from hpar.strategies.job.contract import load_job

pytestmark = pytest.mark.multiprocess

# Adam with a schedule: its moments, step counts and the schedule's position cross the resume;
# hpar_layers() for the pipeline (an embedding, a mean over its 3 ids, an MLP)
SCRIPT = """
import torch, torch.nn as nn
HPAR = {"steps": 6, "batch_size": 4, "lr": 0.01, "log_every": 1}
class Mean(nn.Module):
    def forward(self, x):
        return x.mean(1)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(500, 8)
        self.mean = Mean()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    def forward(self, ids):
        return self.body(self.mean(self.emb(ids))).squeeze(1)
    def hpar_layers(self):
        return nn.Sequential(self.emb, self.mean, *self.body)
def model():
    return Net()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(77 + 10 * rank + world_size)
    while True:
        ids = torch.randint(0, 500, (batch_size, 3), generator=g)
        yield ids, (ids.float().mean(1) / 500)
def loss(output, targets):
    return ((output.reshape(-1) - targets) ** 2).mean()
def optimizer(params):
    return torch.optim.Adam(params, lr=HPAR["lr"])
def scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
"""


def reference(script: str, shapes: list[tuple[int, int]]) -> dict:
    """One process: for each (data-parallel width N, steps), that many steps on the
    concatenation of data(r, N) for r < N, each stream resuming at the step reached."""
    job = load_job(script)
    torch.manual_seed(0)
    model = job.build_model()
    opt = job.build_optimizer(model.parameters(), 0.01)
    sched = job.build_scheduler(opt)
    done = 0
    for width, steps in shapes:
        streams = [job.batches(r, width, 4) for r in range(width)]
        for s in streams:
            for _ in range(done):
                next(s)
        for _ in range(steps):
            pairs = [next(s) for s in streams]
            opt.zero_grad()
            job.compute_loss(
                call_model(model, _concat([p[0] for p in pairs])), _concat([p[1] for p in pairs])
            ).backward()
            opt.step()
            sched.step()
        done += steps
    return model.state_dict()


def run(tmp_path, name: str, *args: str) -> str:
    run_dir = tmp_path / "run"
    rc, out = hpar_to_file(
        tmp_path / f"{name}.txt", "run", *args, "--plain", "--no-eval", cwd=str(tmp_path), timeout=200
    )
    assert rc == 0, out[-3000:]
    assert not kill_left(run_dir)
    return out


def final(tmp_path) -> dict:
    from conftest import final_state

    return final_state(tmp_path / "run")


def close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize(
    "strategy,before,after,widths",
    [
        ("allreduce", ("--gpus", "2"), ("--gpus", "4"), (2, 4)),
        ("hybrid", ("--gpus", "2", "--servers", "1"), ("--gpus", "3", "--servers", "2"), (2, 3)),
        ("fsdp", ("--gpus", "2"), ("--gpus", "3"), (2, 3)),  # each rank's shards, resharded by DCP
    ],
    ids=["allreduce-2-to-4", "hybrid-2w1s-to-3w2s", "fsdp-2-to-3"],
)
def test_data_parallel_resumes_at_another_size(tmp_path, strategy, before, after, widths):
    script = write_script(tmp_path, SCRIPT)
    run(
        tmp_path,
        "first",
        script,
        "--strategy",
        strategy,
        *before,
        "--steps",
        "3",
        "--checkpoint-every",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
    )
    out = run(tmp_path, "resumed", "--resume", str(tmp_path / "run"), *after, "--steps", "6")
    assert f"hpar: resuming {widths[0]} workers" in out and f"as {widths[1]} workers" in out, out
    assert f"the global batch changes from {4 * widths[0]} to {4 * widths[1]} samples per step" in out, out
    close(final(tmp_path), reference(script, [(widths[0], 3), (widths[1], 3)]))


def test_pipeline_resumes_with_its_stages_cut_again(tmp_path):
    """2 stages to 4 (one pipeline, the same batches): each new stage reads the layers it
    holds, with their Adam state, whatever stage wrote them; the global batch stays."""
    script = write_script(tmp_path, SCRIPT)
    pipe = ("--strategy", "pipeline", "--pipeline-replicas", "1", "--micro-batches", "2")
    run(
        tmp_path,
        "first",
        script,
        *pipe,
        "--gpus",
        "2",
        "--steps",
        "3",
        "--checkpoint-every",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
    )
    out = run(tmp_path, "resumed", "--resume", str(tmp_path / "run"), *pipe, "--gpus", "4", "--steps", "6")
    assert (
        "resuming 2 stages x 1 replica (pipeline) as 4 stages x 1 replica (pipeline); the global batch stays 4" in out
    ), out
    close(final(tmp_path), reference(script, [(1, 6)]))
