"""Checks of what a run reads and writes, made before any process starts: the run directory
is a writable directory, a plan's pipeline stages are well formed, the checkpoint a resume
or restart starts from is complete (every part present and matching its SHA-256), falling back
to the previous complete checkpoint with a message when the newest is damaged, and whether a
resumed run has anything left to do."""

from __future__ import annotations

import json
import os
import tempfile

from hpar.strategies.specs.decision import Plan
from hpar.strategies.state import checkpoint
from hpar.strategies.state.trust import check_trusted, check_unmarked


def check_run_dir(path: str, flag: str = "--run-dir") -> None:
    """ValueError (one line naming ``path`` and the fix) unless ``path`` is a directory this
    process can write, or can be created as one (nothing is created here), that this user
    alone can write (strategies/state/trust.py) and, for ``--run-dir``, that is new, empty
    or marked as hpar's (a resumed run may predate the marker)."""
    check_trusted(path, flag)
    if flag == "--run-dir":
        check_unmarked(path, flag)
    probe_dir = path
    while not os.path.exists(probe_dir):
        probe_dir = os.path.dirname(probe_dir) or "."
    if not os.path.isdir(probe_dir):
        what = path if probe_dir == path else f"{path} (its parent {probe_dir})"
        raise ValueError(f"{flag} {what}: is a file, not a directory; pick a new directory name")
    try:
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(
            f"{flag} {path}: cannot write in {probe_dir} ({exc.strerror}); pick a writable directory"
        ) from None


def check_plan_stages(plan: Plan, model, world_size: int, source: str, example=None) -> None:
    """ValueError naming ``source`` when ``plan.stages`` is not ``world_size`` contiguous
    ``[start, end)`` layer ranges covering ``model``'s layers (``example``: inputs to trace a
    model that is not a declared sequence on)."""
    stages = plan.stages
    if not stages:
        return
    if not (
        isinstance(stages, list)
        and all(
            isinstance(s, (list, tuple))
            and len(s) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in s)
            for s in stages
        )
    ):
        raise ValueError(
            f"{source}: 'stages' must be a list of [start, end] layer index pairs, got {stages!r:.80}; "
            "write the plan with `hpar profile --plan-out`"
        )
    from hpar.strategies.plan.stage_cuts import stage_ranges

    try:
        stage_ranges(model, world_size, plan, example)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def resume_step(run_dir: str, say) -> int | None:
    """The checkpoint step a resume of ``run_dir`` starts from (None: there is none). When
    ``latest`` is damaged or names a checkpoint that does not verify, ``latest`` is pointed at
    the newest complete one and ``say`` tells why; ValueError naming the files when there is
    a checkpoint but none verifies, or when its pickles name anything but checkpoint data
    (strategies/state/safe_read.py: refused here, before any process loads it)."""
    step, problems = checkpoint.usable_step(run_dir)
    if step is None and problems:
        raise ValueError(f"{run_dir}: no complete checkpoint to resume from ({'; '.join(problems)}); start a new run")
    if step is not None:
        from hpar.strategies.state.safe_read import check  # imports torch.distributed.checkpoint: only here

        check(checkpoint.step_dir(run_dir, step))
    if problems and step is not None:
        say(f"hpar: {problems[0]}; resuming from the previous complete checkpoint, step {step}")
        checkpoint.point_latest(run_dir, step)
    return step


def finished(run_dir: str, steps: int) -> dict | None:
    """The run's own summary.json when the run in ``run_dir`` finished (exit code 0, its
    model written) at ``steps`` or beyond: a resume to ``steps`` has nothing to do. None when
    it did not, or when it cannot tell (no summary, a torn one)."""
    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    done = isinstance(summary, dict) and summary.get("exit_code") == 0 and isinstance(summary.get("steps"), int)
    from hpar.strategies.state.state import FINAL

    if not done or summary["steps"] < steps or not os.path.exists(os.path.join(run_dir, FINAL, ".metadata")):
        return None
    return summary
