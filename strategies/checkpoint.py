"""Crash-safe files: write to a temporary file in the same directory, fsync, then rename, so
a reader sees either the old file or the new one, never a torn one."""
from __future__ import annotations

import os
import tempfile

import torch


_UMASK = os.umask(0o022)
os.umask(_UMASK)   # read once at import: the process's umask, for files made by mkstemp


def _atomic_write(path: str, write) -> None:
    """Call ``write(binary file)`` on a temp file beside ``path``, fsync it, and rename it over
    ``path``; on any failure the temp file is removed and ``path`` is left as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)   # as open() would create it (mkstemp makes 0600): same as the logs beside it
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + os.replace)."""
    _atomic_write(path, lambda f: f.write(data))


def atomic_save(obj, path: str) -> None:
    """``torch.save(obj, path)`` through a temp file and rename."""
    _atomic_write(path, lambda f: torch.save(obj, f))


def load(path: str):
    """Load a checkpoint written by :func:`atomic_save` (on CPU)."""
    return torch.load(path, map_location="cpu", weights_only=False)


# --- Run checkpoints -------------------------------------------------------------------
# Layout: RUN_DIR/checkpoints/step-<N>/<part>.pt, one part per process that holds state
# (e.g. "worker0", "server1", "stage2"), and RUN_DIR/checkpoints/latest naming the newest
# complete step. `latest` is only rewritten after every process has written its part
# (a barrier over the default process group), so a crash mid-save leaves the previous
# checkpoint intact and `--resume` never sees a partial step.

def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step-{step}")


def save_part(run_dir: str, step: int, part: str, state: dict) -> None:
    """Write this process's ``state`` for ``step`` (atomically). Call :func:`commit` next."""
    atomic_save(state, os.path.join(step_dir(run_dir, step), f"{part}.pt"))


def commit(run_dir: str, step: int) -> None:
    """Collective over the default process group: once every process has saved its part,
    global rank 0 points ``latest`` at ``step``."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        if dist.get_rank() != 0:
            return
    atomic_write_bytes(os.path.join(run_dir, "checkpoints", "latest"), str(step).encode())


def latest_step(run_dir: str) -> int | None:
    """The newest committed step in ``run_dir``, or None when there is none."""
    path = os.path.join(run_dir, "checkpoints", "latest")
    if not os.path.exists(path):
        return None
    return int(open(path).read().strip())


def load_part(run_dir: str, step: int, part: str) -> dict:
    """This process's state for ``step``; raises ValueError naming the file if missing."""
    path = os.path.join(step_dir(run_dir, step), f"{part}.pt")
    if not os.path.exists(path):
        raise ValueError(f"{path}: checkpoint part missing; was the run started with the same --gpus/--servers?")
    return load(path)
