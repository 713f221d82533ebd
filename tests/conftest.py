"""Shared test helpers: tiny user scripts, running the hpar CLI in a subprocess, finding
every process that belongs to a run (by the HPAR_CONFIG path in its environment), and the
single-process training every synchronous strategy must reproduce."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest

# This is the CPU suite: its runs put 2-4 workers on one machine, which hpar refuses on GPUs (one
# GPU per worker), and it checks CPU-only figures. On a machine with GPUs they are hidden from
# the tests and everything they start; scripts/gpu_check.sh runs the GPU checks.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from support.runprocs import run_processes, wait_for  # noqa: E402,F401  (shared with scripts/chaos.py)

TINY = """
import torch, torch.nn as nn
HPAR = {"steps": 20, "batch_size": 8, "lr": 0.1, "log_every": 5}
def model():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(10_000):
        x = torch.randn(batch_size, 4, generator=g)
        yield x, x.sum(1, keepdim=True)
def loss(output, targets):
    return ((output - targets) ** 2).mean()
def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)
def evaluate(model):
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(7))
    return {"mse": float(((model(x) - x.sum(1, keepdim=True)) ** 2).mean())}
"""


# A tiny model with one embedding table (served by the parameter servers under hybrid/ps);
# SLEEP seconds per batch make it slow enough to interrupt.
EMBED_TINY = """
import time, torch, torch.nn as nn
HPAR = {"steps": STEPS, "batch_size": 4, "lr": 0.1, "log_every": 2}
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 8)
        self.out = nn.Linear(8, 1)
    def forward(self, x):
        return self.out(self.emb(x)).squeeze(1)
def model(): return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        time.sleep(SLEEP)
        yield torch.randint(0, 1000, (batch_size,), generator=g), torch.randn(batch_size, generator=g)
def loss(o, t): return ((o - t) ** 2).mean()
"""


def embed_script(steps: int = 10, sleep: float = 0.0) -> str:
    """EMBED_TINY with ``steps`` steps and ``sleep`` seconds per batch."""
    return EMBED_TINY.replace("STEPS", str(steps)).replace("SLEEP", repr(sleep))


def finite_positive(x) -> bool:
    """Whether ``x`` is an int or float, finite and above 0 (figures a run reports)."""
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def write_script(tmp_path, text: str = TINY, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def tiny_script(tmp_path) -> str:
    return write_script(tmp_path)


def hpar(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run ``python -m hpar.launcher.cli ARGS`` and capture its output (text)."""
    return subprocess.run(
        [sys.executable, "-m", "hpar.launcher.cli", *args], capture_output=True, text=True, timeout=timeout, **kw
    )


def hpar_to_file(out, *args: str, timeout: float = 240, cwd=None, env=None) -> tuple[int, str]:
    """Run ``python -m hpar.launcher.cli ARGS`` with stdout and stderr to the file ``out`` and
    stdin closed, as a batch job or CI runs it; returns (exit code, the output)."""
    with open(out, "w") as f:
        code = subprocess.run(
            [sys.executable, "-m", "hpar.launcher.cli", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            cwd=cwd,
            env=env,
        ).returncode
    with open(out) as f:
        return code, f.read()


def kill_left(run_dir) -> list:
    """Kill every process of the run in ``run_dir`` that is still alive; returns them (psutil
    processes: a test fails on any, since a finished `hpar` command must leave none)."""
    left = run_processes(str(run_dir))
    for p in left:
        p.kill()
    return left


@pytest.fixture
def reap_run():
    """Register run dirs; after the test, fail if any of their processes is alive (and kill it)."""
    dirs: list[str] = []
    yield dirs.append
    leftovers = [p for d in dirs for p in kill_left(d)]
    assert not leftovers, f"processes left behind: {[p.pid for p in leftovers]}"


def final_state(run_dir) -> dict:
    """The trained model's state_dict a run left: RUN_DIR/model (torch.distributed.checkpoint,
    every process's part: strategies/state/state.py), read whole in this process."""
    from hpar.strategies.state import state

    saved = state.read_all(os.path.join(str(run_dir), "model"))
    return {k[len("model.") :]: v for k, v in saved.items() if k.startswith("model.")}


def _concat(parts):
    """Concatenate along dim 0 a list of batches: tensors, or tuples/lists/dicts of them."""
    import torch

    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    if isinstance(parts[0], dict):
        return {k: _concat([p[k] for p in parts]) for k in parts[0]}
    return type(parts[0])(_concat([p[k] for p in parts]) for k in range(len(parts[0])))


def single_process_reference(
    script: str, world_size: int, steps: int, batch_size: int, lr: float, seed: int = 0, losses: list | None = None
) -> dict:
    """One process trained ``steps`` steps, each on the concatenation of every rank's batch
    (mean loss): what N synchronous data-parallel workers must equal. Returns its state_dict;
    appends each step's loss to ``losses`` when given. The model is called as hpar calls it
    (``model(**inputs)`` for a dict of its forward's names, strategies/job/forward.py)."""
    import torch
    from hpar.strategies.job.forward import call_model
    from hpar.strategies.job.contract import load_job

    job = load_job(script)
    torch.manual_seed(seed)
    model = job.build_model()
    opt = job.build_optimizer(model.parameters(), lr)
    streams = [job.batches(r, world_size, batch_size) for r in range(world_size)]
    for _ in range(steps):
        pairs = [next(s) for s in streams]
        opt.zero_grad()
        loss = job.compute_loss(call_model(model, _concat([p[0] for p in pairs])), _concat([p[1] for p in pairs]))
        loss.backward()
        opt.step()
        if losses is not None:
            losses.append(float(loss))
    return model.state_dict()
