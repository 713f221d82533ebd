"""A run directory from elsewhere is data, not code (strategies/state/safe_read.py), through
the real CLI: a crafted ``model/.metadata`` stops ``hpar export``, a crafted checkpoint
``.metadata`` or non-tensor item in a ``.distcp`` stops ``hpar run --resume``, each with exit 2
and one line naming the file, and what the file asks for never runs. The crafted files carry
matching ``.sha256`` files: whoever writes the files writes the sums."""

from __future__ import annotations

import builtins
import io
import os
import pickle
import shutil

import pytest
import torch

from conftest import hpar_to_file, kill_left, write_script

pytestmark = pytest.mark.multiprocess

TRUST = "not checkpoint data; refusing to load it (a run directory's files are code: only load runs you trust)"


class Opens:
    """Unpickles as ``open(marker, "w")`` (pickled as ``io.open``): it creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step allreduce run with checkpoints at steps 2 and 4 (copied per test)."""
    from conftest import TINY

    base = tmp_path_factory.mktemp("trained")
    script = write_script(base, TINY)
    run_dir = base / "run"
    rc, out = hpar_to_file(
        base / "out.txt",
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "allreduce",
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--run-dir",
        str(run_dir),
        "--plain",
        "--no-eval",
    )
    assert rc == 0 and not kill_left(run_dir), out[-3000:]
    return run_dir


def copy_run(trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    return run_dir


def resign(path) -> None:
    """Rewrite the SHA-256 beside ``path`` as hpar writes it (strategies/state/checkpoint.py)."""
    from hpar.strategies.state.checkpoint import file_sha256

    with open(f"{path}.sha256", "w") as f:
        f.write(file_sha256(str(path)))


def craft_metadata(directory, marker) -> str:
    path = os.path.join(directory, ".metadata")
    with open(path, "wb") as f:
        pickle.dump(Opens(marker), f)
    resign(path)
    return path


def craft_byte_item(directory, marker, prefix: str = "optim.param_groups.") -> tuple[str, str]:
    """Point a non-tensor item of the checkpoint in ``directory`` (one a resumed worker
    loads) at ``torch.save`` bytes of :class:`Opens`, appended to its ``.distcp`` file;
    rewrite the metadata (DCP's own types) and both checksums. Returns (the file, the key)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = os.path.join(directory, ".metadata")
    with open(meta, "rb") as f:
        md = pickle.load(f)  # the test's own run: trusted
    index, info = next(
        (i, s)
        for i, s in sorted(md.storage_data.items(), key=lambda kv: kv[0].fqn)
        if i.fqn.startswith(prefix) and isinstance(md.state_dict_metadata[i.fqn], BytesStorageMetadata)
    )
    buf = io.BytesIO()
    torch.save(Opens(marker), buf)
    target = os.path.join(directory, info.relative_path)
    info.offset, info.length = os.path.getsize(target), len(buf.getvalue())
    with open(target, "ab") as f:
        f.write(buf.getvalue())
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    resign(target)
    resign(meta)
    return target, index.fqn


def one_refusal(out: str, file: str) -> str:
    """The one line of ``out`` naming ``file`` and the refusal (and no traceback anywhere)."""
    lines = [ln for ln in out.splitlines() if TRUST in ln]
    assert len(lines) == 1 and file in lines[0] and "Traceback" not in out, out[-3000:]
    return lines[0]


def test_export_refuses_a_crafted_model_metadata(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    marker = tmp_path / "ran"
    meta = craft_metadata(run_dir / "model", marker)
    rc, out = hpar_to_file(
        tmp_path / "export.txt", "export", str(run_dir), "--format", "safetensors", "--out", str(tmp_path / "st")
    )
    assert rc == 2 and not marker.exists(), out[-3000:]
    assert out.strip() == f"hpar: {meta}: names io.open, {TRUST}", out
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize("what", ["metadata", "item"])
def test_resume_refuses_a_crafted_checkpoint_before_any_process_starts(trained, tmp_path, what, reap_run):
    from hpar.strategies.state import checkpoint

    run_dir = copy_run(trained, tmp_path)
    reap_run(run_dir)
    marker = tmp_path / "ran"
    step = checkpoint.latest_step(str(run_dir))
    assert step == 4
    if what == "metadata":
        file, says = craft_metadata(checkpoint.step_dir(str(run_dir), step), marker), "names io.open"
    else:
        file, key = craft_byte_item(checkpoint.step_dir(str(run_dir), step), marker)
        says = f"(item {key}) names io.open"
    assert checkpoint.verify_step(str(run_dir), step) is None  # the sums match: they prove nothing
    rc, out = hpar_to_file(
        tmp_path / "resume.txt", "run", "--resume", str(run_dir), "--steps", "6", "--plain", "--no-eval"
    )
    assert rc == 2 and not marker.exists(), out[-3000:]
    assert says in one_refusal(out, file)
    assert not kill_left(run_dir)
    assert checkpoint.latest_step(str(run_dir)) == 4  # nothing started, nothing written


def test_a_refused_checkpoint_is_code_to_torch_itself(trained, tmp_path):
    """The vectors are real: torch's own readers run both crafted files."""
    import torch.distributed.checkpoint as dcp
    from hpar.strategies.state import checkpoint

    run_dir = copy_run(trained, tmp_path)
    path = checkpoint.step_dir(str(run_dir), 4)
    _, key = craft_byte_item(path, tmp_path / "item-ran")
    dcp.load({key: None}, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    assert (tmp_path / "item-ran").exists()
    craft_metadata(path, tmp_path / "metadata-ran")
    dcp.FileSystemReader(path).read_metadata()
    assert (tmp_path / "metadata-ran").exists()
