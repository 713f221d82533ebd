"""How an exception raised by the user's code is reported as the user's (docs/contract.md): one
line naming the file, line and function of the innermost frame in the script, then the user's
own traceback (hpar's and torch's calling frames above it dropped) in ``JobError.user_traceback``.
``job`` here is a Job (strategies/job/contract.py): only its script's absolute ``path`` is read."""

from __future__ import annotations

import os
import traceback
from typing import Callable

from hpar.strategies.job.errors import JobError


def describe_error(exc: BaseException) -> str:
    """``Type: message`` on one line, with the fix for a package the script needs but lacks."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        text += (
            f" (install the package that provides {exc.name!r}; for hpar's own examples: pip install -e '.[examples]')"
        )
    return text


def user_frame(job, tb) -> traceback.FrameSummary | None:
    """The innermost frame of ``tb`` in the user's script (None if none is)."""
    frames = [f for f in traceback.extract_tb(tb) if os.path.abspath(f.filename) == job.path]
    return frames[-1] if frames else None


def where_in_script(job, frame: traceback.FrameSummary | None, what: str) -> str:
    """``FILE:LINE: function()`` of ``frame`` in the user's script, ``FILE: what`` without one."""
    return f"{job.path}:{frame.lineno}: {frame.name}()" if frame else f"{job.path}: {what}"


def user_traceback_of(job, exc: BaseException) -> str:
    """The traceback of ``exc`` from the first frame in the user's script on (hpar's and
    torch's calling frames above it dropped; all of it when the script is not on the stack)."""
    te = traceback.TracebackException.from_exception(exc)
    first = next((i for i, f in enumerate(te.stack) if os.path.abspath(f.filename) == job.path), 0)
    te.stack = traceback.StackSummary.from_list(list(te.stack)[first:])
    return "".join(te.format())


def call_user(job, what: str, fn: Callable, *args):
    """``fn(*args)`` where ``fn`` runs the user's code (their model's forward, a backward
    through their layers). An exception becomes a JobError whose one line names the file,
    line and function of the user's code where it was raised (``what`` when no frame of the
    script is on the stack), with the user's traceback kept in ``user_traceback``."""
    try:
        return fn(*args)
    except JobError:
        raise
    except Exception as exc:
        raise user_error(job, exc, what) from exc


def user_error(job, exc: BaseException, what: str, during: str = "") -> JobError:
    """The JobError for ``exc`` raised by the user's code: one line naming the file, line and
    function of the innermost frame in the script (``what`` when none is on the stack), then
    ``during`` in brackets when given (e.g. "while profiling on cuda:0"); the user's
    traceback in ``user_traceback``."""
    where = where_in_script(job, user_frame(job, exc.__traceback__), what)
    tail = f" ({during})" if during else ""
    return JobError(f"{where} raised {describe_error(exc)}{tail}", user_traceback=user_traceback_of(job, exc))


def raised_in_script(job, exc: BaseException) -> bool:
    """Whether a frame of the user's script is on ``exc``'s traceback (their code raised it,
    or called what raised it)."""
    return user_frame(job, exc.__traceback__) is not None
