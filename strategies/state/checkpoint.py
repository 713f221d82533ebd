"""Crash-safe files: write to a temporary file in the same directory, fsync, then rename, so
a reader sees either the old file or the new one, never a torn one."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import tempfile

from hpar.strategies.common import activity


_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once at import: the process's umask, for files made by mkstemp


def default_mode(directory: bool = False) -> int:
    """The mode ``open()`` (0o666) or ``os.makedirs`` (0o777) gives under this process's umask,
    for what mkstemp/mkdtemp made 0600/0700 and is then renamed into place (read at import:
    no umask flip while other threads create files)."""
    return (0o777 if directory else 0o666) & ~_UMASK


def _atomic_write(path: str, write, private: bool = False) -> None:
    """Call ``write(binary file)`` on a temp file beside ``path``, fsync it, and rename it over
    ``path``; on any failure the temp file is removed and ``path`` is left as it was. The file
    gets the mode ``open()`` would give it, or 0600 from its creation when ``private`` (a file
    that must never be readable by others, not even for a moment)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)  # made 0600, without a race
    try:
        if not private:
            os.fchmod(fd, default_mode())  # as open() would create it: same as the logs beside it
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_TEMP = re.compile(r"^\.tmp-[A-Za-z0-9_]{8}$")  # tempfile.mkstemp(prefix=".tmp-"): the prefix and 8 random characters


def _own_folders(run_dir: str) -> list[str]:
    """The folders of a run where hpar's writes leave temp files: the run directory, its
    ``stacks/``, ``checkpoints/``, every ``checkpoints/step-N/``, ``model/`` and ``.tmp-model/``."""
    folders = [
        run_dir,
        os.path.join(run_dir, "stacks"),
        os.path.join(run_dir, "checkpoints"),
        os.path.join(run_dir, "model"),
        os.path.join(run_dir, ".tmp-model"),
    ]
    return folders + [step_dir(run_dir, step) for step in steps_on_disk(run_dir)]


def remove_temp_files(run_dir: str) -> list[str]:
    """Remove the temp files :func:`_atomic_write` left in a marked run directory's own
    folders (a process killed mid-write cannot remove its own: ``.tmp-`` and mkstemp's 8
    random characters, regular files only); returns their paths. A folder without hpar's
    marker (strategies/state/trust.py) is left alone. Call only while no process of the
    run writes (before it starts, after teardown)."""
    from hpar.strategies.state.trust import is_marked

    if not is_marked(run_dir):
        return []
    removed = []
    for folder in _own_folders(run_dir):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            if _TEMP.match(name) and os.path.isfile(path) and not os.path.islink(path):
                try:
                    os.unlink(path)
                    removed.append(path)
                except OSError:
                    pass
    return removed


def remove_incomplete_steps(run_dir: str) -> list[str]:
    """Remove the ``checkpoints/step-N`` directories newer than ``latest`` (a save that did not
    complete: its processes may have written part of it) and a final model's unfinished
    ``.tmp-model`` of a marked run directory (strategies/state/trust.py; an unmarked one is
    left alone); returns their paths. Call only while no process of the run writes."""
    import shutil
    from hpar.strategies.state.trust import is_marked

    removed = []
    if not is_marked(run_dir):
        return removed
    tmp_model = os.path.join(run_dir, ".tmp-model")  # the final model's, before its rename (strategies/state/state.py)
    if os.path.isdir(tmp_model):
        shutil.rmtree(tmp_model, ignore_errors=True)
        removed.append(tmp_model)
    try:
        latest = latest_step(run_dir)
    except ValueError:
        return removed  # a damaged `latest`: usable_step() decides what is left
    for step in steps_on_disk(run_dir):
        if latest is None or step > latest:
            path = step_dir(run_dir, step)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def atomic_write_bytes(path: str, data: bytes, private: bool = False) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + os.replace); ``private``: mode
    0600 from the file's creation (see :func:`_atomic_write`)."""
    _atomic_write(path, lambda f: f.write(data), private)


def atomic_save(obj, path: str) -> None:
    """``torch.save(obj, path)`` through a temp file and rename."""
    import torch  # here, not at import: the command line reads this module without torch

    _atomic_write(path, lambda f: torch.save(obj, f))


# --- Run checkpoints -------------------------------------------------------------------
# Layout: RUN_DIR/checkpoints/step-<N>/ holds torch.distributed.checkpoint's files, every
# process's own (strategies/state/state.py writes them), a SHA-256 beside each, and
# RUN_DIR/checkpoints/latest names the newest complete step. `latest` is only rewritten after
# every process has written (a barrier over the default process group), so a crash mid-save
# leaves the previous checkpoint intact and `--resume` never sees a partial step.


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step-{step}")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_step(run_dir: str, step: int) -> str | None:
    """None when checkpoint ``step`` (torch.distributed.checkpoint's files: strategies/state/state.py)
    has its metadata and every file matches the SHA-256 beside it, else why not (naming the
    file)."""
    directory = step_dir(run_dir, step)
    if not os.path.isdir(directory):
        return f"{directory}: no such directory"
    return verify_dir(directory)


def verify_dir(path: str) -> str | None:
    """None when the DCP checkpoint in ``path`` has its ``.metadata`` and every file matches the
    SHA-256 beside it (written by the process that wrote the file), else why not."""
    if not os.path.exists(os.path.join(path, ".metadata")):
        return f"{path}: no .metadata (the checkpoint was not completed)"
    for sha in sorted(glob.glob(os.path.join(path, "*.sha256")) + glob.glob(os.path.join(path, ".*.sha256"))):
        target = sha[: -len(".sha256")]
        try:
            if file_sha256(target) != open(sha).read().strip():
                return f"{target}: checksum mismatch (truncated or altered)"
        except OSError as exc:
            return f"{target}: {exc.strerror}"
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
    candidates = (
        steps_on_disk(run_dir)
        if latest is None and problems
        else [s for s in steps_on_disk(run_dir) if latest is not None and s <= latest]
    )
    for step in candidates:
        why = verify_step(run_dir, step)
        if why is None:
            return step, problems
        problems.append(why)
    return None, problems


def point_latest(run_dir: str, step: int) -> None:
    """Rewrite ``latest`` to ``step`` (used to fall back to an older complete checkpoint)."""
    atomic_write_bytes(os.path.join(run_dir, "checkpoints", "latest"), str(step).encode())


def commit(run_dir: str, step: int, keep: int = 0) -> None:
    """Collective over the default process group: once every process has saved its part,
    global rank 0 points ``latest`` at ``step`` and keeps the ``keep`` newest complete
    checkpoints (:func:`prune`; 0 keeps all)."""
    import torch.distributed as dist

    if dist.is_initialized():
        with activity.doing(None):  # waiting for the slowest writer is no deadline of this process's
            dist.barrier()
        if dist.get_rank() != 0:
            return
    atomic_write_bytes(os.path.join(run_dir, "checkpoints", "latest"), str(step).encode())
    prune(run_dir, keep)


def prune(run_dir: str, keep: int) -> list[str]:
    """Remove the checkpoints of a marked run (strategies/state/trust.py) older than its
    ``keep`` newest at or before ``latest``; returns their paths. Never one newer than
    ``latest`` (being written) nor ``latest`` itself; ``keep`` 0 removes nothing. Rank 0 calls
    it right after moving ``latest``, while the others may already write the next step."""
    import shutil
    from hpar.strategies.state.trust import is_marked

    assert keep >= 0, keep
    try:
        latest = latest_step(run_dir)
    except ValueError:
        return []
    if keep == 0 or latest is None or not is_marked(run_dir):
        return []
    complete = [s for s in steps_on_disk(run_dir) if s <= latest]  # newest first
    removed = []
    for step in complete[keep:]:
        shutil.rmtree(step_dir(run_dir, step), ignore_errors=True)
        removed.append(step_dir(run_dir, step))
    return removed


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
