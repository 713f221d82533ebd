"""Crash-safe files: write to a temporary file in the same directory, fsync, then rename, so
a reader sees either the old file or the new one, never a torn one."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
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


def remove_temp_files(directory: str) -> list[str]:
    """Remove the ``.tmp-*`` files :func:`_atomic_write` left under ``directory`` (a process
    killed mid-write cannot remove its own), and the ``.tmp-*`` directories of an unfinished
    :func:`save_sharded`; returns their paths. Call only while no process of the run writes
    (before it starts, after teardown)."""
    removed = []
    for root, dirs, files in os.walk(directory):
        for name in [d for d in dirs if d.startswith(".tmp-")]:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(os.path.join(root, name))
            dirs.remove(name)
        for name in files:
            if name.startswith(".tmp-"):
                path = os.path.join(root, name)
                try:
                    os.unlink(path)
                    removed.append(path)
                except OSError:
                    pass
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


class _Hashing:
    """A binary file that also feeds every byte written to a SHA-256."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_part(run_dir: str, step: int, part: str, state: dict) -> None:
    """Write this process's ``state`` for ``step`` (atomically), with ``<part>.pt.sha256``
    beside it (the SHA-256 of the file, written after it) for :func:`verify_step`. Call
    :func:`commit` next."""
    path = os.path.join(step_dir(run_dir, step), f"{part}.pt")
    digest = []

    def write(f) -> None:
        h = _Hashing(f)
        torch.save(state, h)
        digest.append(h.sha.hexdigest())
    _atomic_write(path, write)
    atomic_write_bytes(path + ".sha256", digest[0].encode())


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_step(run_dir: str, step: int) -> str | None:
    """None when every part of checkpoint ``step`` is present and matches its SHA-256 (a part
    written before checksums existed must load instead), and so does every file of its sharded
    state (:func:`save_sharded`), else why not (naming the file)."""
    directory = step_dir(run_dir, step)
    try:
        parts = sorted(n for n in os.listdir(directory) if n.endswith(".pt"))
    except OSError as exc:
        return f"{directory}: {exc.strerror}"
    if not parts:
        return f"{directory}: no checkpoint part"
    sharded = os.path.join(directory, SHARDED)
    if os.path.isdir(sharded):
        for name in sorted(os.listdir(sharded)):
            path = os.path.join(sharded, name)
            if name.endswith(".sha256"):
                continue
            if not os.path.exists(path + ".sha256") or file_sha256(path) != open(path + ".sha256").read().strip():
                return f"{path}: checksum mismatch or missing (truncated or altered)"
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


SHARDED = "sharded"   # the directory of a step's torch.distributed.checkpoint state (fsdp)


def save_sharded(run_dir: str, step: int, state: dict, rank: int) -> None:
    """Collective over the default process group: every process writes its shards of
    ``state`` (DTensors, as ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives
    them) with ``torch.distributed.checkpoint.save`` into a ``.tmp-`` directory of step
    ``step``, which rank 0 then renames to ``step-N/sharded`` and checksums file by file (one
    ``.sha256`` beside each, for :func:`verify_step`). The run directory must be one filesystem
    for every host (rank 0 writes the metadata every rank reads). Call :func:`commit` after the
    processes' parts."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    final = os.path.join(step_dir(run_dir, step), SHARDED)
    tmp = os.path.join(step_dir(run_dir, step), ".tmp-" + SHARDED)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()
    if rank == 0:
        for name in os.listdir(tmp):
            atomic_write_bytes(os.path.join(tmp, name + ".sha256"), file_sha256(os.path.join(tmp, name)).encode())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)


def load_sharded(run_dir: str, step: int, state: dict) -> None:
    """Fill ``state`` (DTensors of this process's shards, as :func:`save_sharded` took them)
    from step ``step``'s sharded checkpoint, whatever the processes that wrote it (DCP
    reshards); a collective. ValueError naming the directory when it is missing."""
    import torch.distributed.checkpoint as dcp
    path = os.path.join(step_dir(run_dir, step), SHARDED)
    if not os.path.isdir(path):
        raise ValueError(f"{path}: sharded checkpoint missing; was the run started with --strategy fsdp?")
    dcp.load(state, checkpoint_id=path)


def load_part(run_dir: str, step: int, part: str) -> dict:
    """This process's state for ``step``; raises ValueError naming the file if missing."""
    path = os.path.join(step_dir(run_dir, step), f"{part}.pt")
    if not os.path.exists(path):
        raise ValueError(f"{path}: checkpoint part missing; was the run started with the same --gpus/--servers?")
    return load(path)
