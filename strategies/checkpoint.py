"""Crash-safe files: write to a temporary file in the same directory, fsync, then rename, so
a reader sees either the old file or the new one, never a torn one."""
from __future__ import annotations

import hashlib
import os
import re
import tempfile

import torch

from hpar.strategies import activity


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


def remove_temp_files(directory: str) -> list[str]:
    """Remove the ``.tmp-*`` files :func:`_atomic_write` left under ``directory`` (a process
    killed mid-write cannot remove its own); returns their paths. Call only while no process
    of the run writes (before it starts, after teardown)."""
    removed = []
    for root, _, files in os.walk(directory):
        for name in files:
            if name.startswith(".tmp-"):
                path = os.path.join(root, name)
                try:
                    os.unlink(path)
                    removed.append(path)
                except OSError:
                    pass
    return removed


def remove_incomplete_steps(run_dir: str) -> list[str]:
    """Remove the ``checkpoints/step-N`` directories newer than ``latest`` (a save that did not
    complete: its processes may have written part of it) and a final model's unfinished
    ``.tmp-model``; returns their paths. Call only while no process of the run writes."""
    import shutil
    removed = []
    tmp_model = os.path.join(run_dir, ".tmp-model")   # the final model's, before its rename (strategies/state.py)
    if os.path.isdir(tmp_model):
        shutil.rmtree(tmp_model, ignore_errors=True)
        removed.append(tmp_model)
    try:
        latest = latest_step(run_dir)
    except ValueError:
        return removed   # a damaged `latest`: usable_step() decides what is left
    for step in steps_on_disk(run_dir):
        if latest is None or step > latest:
            path = step_dir(run_dir, step)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


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


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_step(run_dir: str, step: int) -> str | None:
    """None when every part of checkpoint ``step`` is present and matches its SHA-256 (a part
    written before checksums existed must load instead), else why not (naming the file)."""
    directory = step_dir(run_dir, step)
    try:
        names = os.listdir(directory)
    except OSError as exc:
        return f"{directory}: {exc.strerror}"
    if ".metadata" in names or any(n.endswith(".distcp") for n in names):   # torch.distributed.checkpoint's
        from hpar.strategies.state import verify
        return verify(directory)
    parts = sorted(n for n in names if n.endswith(".pt"))
    if not parts:
        return f"{directory}: no checkpoint part"
    for name in parts:
        path = os.path.join(directory, name)
        try:
            if os.path.exists(path + ".sha256"):
                want = open(path + ".sha256").read().strip()
                if file_sha256(path) != want:
                    return f"{path}: checksum mismatch (truncated or altered)"
            else:
                load(path)
        except Exception as exc:  # unreadable, or torch.load of a torn file
            return f"{path}: does not load ({type(exc).__name__}: {exc})"
    return None


def steps_on_disk(run_dir: str) -> list[int]:
    """Steps that have a ``checkpoints/step-N`` directory, newest first."""
    try:
        names = os.listdir(os.path.join(run_dir, "checkpoints"))
    except OSError:
        return []
    return sorted((int(m[1]) for m in map(re.compile(r"^step-(\d+)$").match, names) if m), reverse=True)


def usable_step(run_dir: str) -> tuple[int | None, list[str]]:
    """The step to resume from and the problems met on the way: ``latest`` when it verifies,
    else the newest older checkpoint that does (never one newer than ``latest``: it may be
    partial). ``(None, problems)`` when none does."""
    problems = []
    try:
        latest = latest_step(run_dir)
    except ValueError as exc:
        problems.append(str(exc))
        latest = None
    candidates = steps_on_disk(run_dir) if latest is None and problems else [
        s for s in steps_on_disk(run_dir) if latest is not None and s <= latest]
    for step in candidates:
        why = verify_step(run_dir, step)
        if why is None:
            return step, problems
        problems.append(why)
    return None, problems


def point_latest(run_dir: str, step: int) -> None:
    """Rewrite ``latest`` to ``step`` (used to fall back to an older complete checkpoint)."""
    atomic_write_bytes(os.path.join(run_dir, "checkpoints", "latest"), str(step).encode())


def commit(run_dir: str, step: int) -> None:
    """Collective over the default process group: once every process has saved its part,
    global rank 0 points ``latest`` at ``step``."""
    import torch.distributed as dist
    if dist.is_initialized():
        with activity.doing(None):   # waiting for the slowest writer is no deadline of this process's
            dist.barrier()
        if dist.get_rank() != 0:
            return
    atomic_write_bytes(os.path.join(run_dir, "checkpoints", "latest"), str(step).encode())


def latest_step(run_dir: str) -> int | None:
    """The newest committed step in ``run_dir``, or None when there is none; ValueError naming
    the file when ``latest`` does not hold a step number."""
    path = os.path.join(run_dir, "checkpoints", "latest")
    if not os.path.exists(path):
        return None
    text = open(path, "rb").read()
    try:
        return int(text.decode().strip())
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"{path}: not a step number ({text[:20]!r}); the file is damaged") from None


def load_part(run_dir: str, step: int, part: str) -> dict:
    """This process's state for ``step``; raises ValueError naming the file if missing."""
    path = os.path.join(step_dir(run_dir, step), f"{part}.pt")
    if not os.path.exists(path):
        raise ValueError(f"{path}: checkpoint part missing; was the run started with the same --gpus/--servers?")
    return load(path)
