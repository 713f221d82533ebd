"""The error a user's script gets when it breaks hpar's contract (docs/contract.md), in a
module of its own so that the command line can name it without importing torch (``hpar
--help`` and usage errors answer in well under a second)."""

from __future__ import annotations


class JobError(ValueError):
    """A user's script breaks the contract. ``str(err)`` is the one-line message to show;
    ``err.user_traceback`` holds the user's own traceback when their code raised."""

    def __init__(self, message: str, user_traceback: str | None = None):
        super().__init__(message)
        self.user_traceback = user_traceback


def check_script_file(path: str) -> str:
    """The absolute path of ``path`` once it is a readable UTF-8 Python file that compiles;
    JobError (one line naming the file, and the line of a syntax error) otherwise. Needs no
    torch: ``hpar run``/``profile`` check the script here before importing anything heavy."""
    import os

    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise JobError(f"{path}: no such file; pass the path of a training script")
    try:
        with open(path, encoding="utf-8") as f:
            compile(f.read(), path, "exec")
    except SyntaxError as exc:
        raise JobError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except UnicodeDecodeError:
        raise JobError(f"{path}: not a UTF-8 text file; pass a Python script") from None
    return path


__all__ = ["JobError", "check_script_file"]
