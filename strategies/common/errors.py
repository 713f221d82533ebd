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


__all__ = ["JobError"]
