"""Run state written where it lives (strategies/state/state.py): a full disk while writing a
checkpoint, and `hpar export` of a run's trained model, through the real CLI."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from conftest import final_state, hpar_to_file, kill_left, write_script

pytestmark = pytest.mark.multiprocess

# a 40,000-row table with Adam: one checkpoint (weights and two moments) is about 4 MB
BIG = """
import torch, torch.nn as nn
HPAR = {"steps": 6, "batch_size": 4, "lr": 0.01, "log_every": 1}
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40000, 8)
        self.out = nn.Linear(8, 1)
    def forward(self, x):
        return self.out(self.emb(x)).squeeze(1)
def model(): return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randint(0, 40000, (batch_size,), generator=g), torch.randn(batch_size, generator=g)
def loss(o, t): return ((o - t) ** 2).mean()
def optimizer(p): return torch.optim.Adam(p, lr=0.01)
"""


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MB tmpfs (root only): room for one checkpoint of BIG, not two."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("strategy", ["allreduce", "hybrid"])
def test_a_full_disk_names_the_path_keeps_the_last_checkpoint_and_resumes(tmp_path, small_disk, strategy):
    from hpar.strategies.state import checkpoint

    script = write_script(tmp_path, BIG)
    run_dir = small_disk / "run"
    rc, out = hpar_to_file(
        tmp_path / "out.txt",
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        strategy,
        "--checkpoint-every",
        "2",
        "--run-dir",
        str(run_dir),
        "--plain",
        "--no-eval",
    )
    assert rc != 0 and not kill_left(run_dir), out
    assert "failed: exit code 2; stopped every other process" in out, out[-3000:]
    assert f"no space left on device writing {run_dir}/checkpoints/step-4" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert checkpoint.latest_step(str(run_dir)) == 2 and checkpoint.verify_step(str(run_dir), 2) is None
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # space freed
    rc, out = hpar_to_file(tmp_path / "resume.txt", "run", "--resume", str(run_dir), "--plain", "--no-eval")
    assert rc == 0 and not kill_left(run_dir), out[-3000:]
    assert checkpoint.latest_step(str(run_dir)) == 6 and set(final_state(run_dir)) == {
        "emb.weight",
        "out.weight",
        "out.bias",
    }


def test_export_writes_torch_and_safetensors_files_of_the_trained_model(tmp_path):
    from safetensors.torch import load_file

    script = write_script(tmp_path, BIG.replace('"steps": 6', '"steps": 2'))
    run_dir = tmp_path / "run"
    rc, out = hpar_to_file(
        tmp_path / "out.txt",
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "hybrid",
        "--run-dir",
        str(run_dir),
        "--plain",
        "--no-eval",
    )
    assert rc == 0 and not kill_left(run_dir), out[-3000:]
    want = final_state(run_dir)
    rc, out = hpar_to_file(
        tmp_path / "e1.txt", "export", str(run_dir), "--format", "torch", "--out", str(tmp_path / "m.pt")
    )
    assert rc == 0 and out.strip() == f"hpar: wrote {tmp_path / 'm.pt'}", out
    got = torch.load(tmp_path / "m.pt")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    rc, out = hpar_to_file(
        tmp_path / "e2.txt", "export", str(run_dir), "--format", "safetensors", "--out", str(tmp_path / "st")
    )
    assert rc == 0, out
    got = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    rc, out = hpar_to_file(tmp_path / "e3.txt", "export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert rc == 2 and "not a transformers model; use --format torch or safetensors" in out, out
    rc, out = hpar_to_file(
        tmp_path / "e4.txt", "export", str(tmp_path), "--format", "torch", "--out", str(tmp_path / "x.pt")
    )
    assert rc == 2 and "no trained model there" in out, out


def test_keep_checkpoints_leaves_the_newest_two_and_the_model_and_resume_goes_on(tmp_path):
    """`--keep-checkpoints 2` with a checkpoint every step for 10 steps (hybrid: workers and
    servers write each one): steps 9 and 10 stay beside the final model; a resume continues
    from 10 and keeps pruning; `0` keeps every one."""
    from conftest import embed_script
    from hpar.strategies.state import checkpoint

    script = write_script(tmp_path, embed_script(steps=10))
    run_dir = tmp_path / "run"
    rc, out = hpar_to_file(
        tmp_path / "out.txt",
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "hybrid",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
        "--run-dir",
        str(run_dir),
        "--plain",
        "--no-eval",
    )
    assert rc == 0 and not kill_left(run_dir), out[-3000:]
    assert checkpoint.steps_on_disk(str(run_dir)) == [10, 9] and (run_dir / "model" / ".metadata").is_file()
    assert checkpoint.verify_step(str(run_dir), 10) is None and checkpoint.verify_step(str(run_dir), 9) is None
    rc, out = hpar_to_file(
        tmp_path / "resume.txt",
        "run",
        "--resume",
        str(run_dir),
        "--steps",
        "13",
        "--plain",
        "--no-eval",
        "--keep-checkpoints",
        "0",
    )
    assert rc == 0 and not kill_left(run_dir), out[-3000:]
    assert checkpoint.steps_on_disk(str(run_dir)) == [13, 12, 11, 10, 9]
    rc, out = hpar_to_file(tmp_path / "bad.txt", "run", script, "--keep-checkpoints", "-1", "--strategy", "allreduce")
    assert rc == 2 and "--keep-checkpoints must not be negative" in out, out
