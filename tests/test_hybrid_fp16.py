"""--precision fp16 under hybrid and ps (strategies/runtimes/hybrid/fp16.py): the scaler's inf/NaN check
covers the rows pushed to the servers, every worker takes the same decision before any push,
and a skipped step changes nothing on the workers or the servers while the LR schedule goes on;
through the real `hpar run`, against one process with torch's GradScaler."""

import json
import os

import pytest
import torch

from hpar.strategies.job.contract import load_job

from conftest import _concat, write_script, final_state
from test_training_loop import close, run_cli

EMBED_FP16 = """
import torch, torch.nn as nn
HPAR = {"steps": 8, "batch_size": 4, "lr": 0.1, "log_every": 1}
BAD_STEP = 3   # worker 0's batch of this step makes its embedding rows' gradient inf (and only those)

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(200, 8)
        self.out = nn.Linear(8, 1)
    def forward(self, x):
        ids, c = x
        e = self.emb(ids)
        ec = e * c    # c: 0, or 1e38 in the bad step: 0 in the forward, an inf row gradient in the backward
        return self.out(e + (ec - ec.detach())).squeeze(1)
def model(): return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    for i in range(10_000):
        c = torch.full((batch_size, 1), 1e38 if (i == BAD_STEP and rank == 0) else 0.0)
        yield (torch.randint(0, 200, (batch_size,), generator=g), c), torch.randn(batch_size, generator=g)
def loss(o, t): return ((o - t) ** 2).mean() * 1e-3   # small enough that fp16 never overflows by itself
def optimizer(params): return torch.optim.Adam(params, lr=0.1)
def scheduler(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=8)
"""


def one_process_fp16(
    script: str, world_size: int, steps: int, batch_size: int, lr: float, seed: int = 0, clip: float = 0.0
) -> tuple[dict, list[bool], list[float]]:
    """One process on the concatenation of every rank's batch, under fp16 autocast with torch's
    GradScaler (unscale, clip, step unless inf/NaN, update the scale, step the schedule).
    Returns (state_dict, whether each step went through, each step's loss)."""
    job = load_job(script)
    torch.manual_seed(seed)
    model = job.build_model()
    opt = job.build_optimizer(model.parameters(), lr)
    sched = job.build_scheduler(opt)
    scaler = torch.amp.GradScaler("cpu")
    streams = [job.batches(r, world_size, batch_size) for r in range(world_size)]
    stepped, losses = [], []
    for _ in range(steps):
        pairs = [next(s) for s in streams]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = job.compute_loss(model(_concat([p[0] for p in pairs])), _concat([p[1] for p in pairs]))
        losses.append(loss.item())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        stepped.append(scaler.get_scale() >= before)
        sched.step()
    return model.state_dict(), stepped, losses


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["hybrid", "ps"])
def test_fp16_skips_a_step_whose_pushed_rows_are_inf_on_every_worker_and_server(tmp_path, strategy):
    """Only worker 0's embedding rows (pushed to the server) are inf in step 3: both workers
    skip their dense step, nothing is pushed, the server leaves its rows and Adam state alone
    and its schedule goes on, so 2 workers and a server equal one process with GradScaler."""
    script = write_script(tmp_path, EMBED_FP16)
    code, run_dir, out = run_cli(
        tmp_path,
        script,
        "--gpus",
        "2",
        "--strategy",
        strategy,
        "--precision",
        "fp16",
        "--clip-grad-norm",
        "0.5",
        "--no-eval",
    )
    assert code == 0, out
    want, stepped, losses = one_process_fp16(script, 2, 8, 4, 0.1, clip=0.5)
    assert stepped == [True, True, True, False, True, True, True, True]  # the marker's step only
    close(final_state(run_dir), want, rtol=1e-3)
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    workers = [[m for m in rows if m["kind"] == "metric" and m["role"] == "worker" and m["rank"] == r] for r in (0, 1)]
    for rank, mine in enumerate(workers):
        skipped = [m["step"] - 1 for m in mine if m.get("skipped_step")]
        assert skipped == [i for i, ok in enumerate(stepped) if not ok], rank
    # the loss curve: each step's mean over the 2 workers' batches is one process's loss
    per_rank = [[m["loss"] for m in mine] for mine in workers]
    assert [(a + b) / 2 for a, b in zip(*per_rank)] == pytest.approx(losses, rel=1e-3), per_rank
