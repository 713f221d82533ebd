"""How every ``hpar`` command ends on bad input: one line ``hpar: message`` on stderr (the
user's own traceback after it, where their code raised), exit code 2 (click's for usage
errors). Shared by the commands, so none imports another or the CLI's entry point.
"""

from __future__ import annotations

import sys

import click

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C


def interrupted(phase: str) -> None:
    """Ctrl-C before any process started (loading, profiling, planning): say so in hpar's
    words, not click's "Aborted!", and exit 130 (docs/faults.md). Never returns."""
    click.echo(f"\nhpar: interrupted (Ctrl-C) while {phase}; nothing was started or left running", err=True)
    sys.exit(EXIT_INTERRUPTED)


def fail(message: str, detail: str | None = None) -> None:
    """Print ``hpar: message`` (plus the user's traceback ``detail``, if any) to stderr and
    exit 2. Never returns."""
    click.echo(f"hpar: {message}", err=True)
    if detail:
        click.echo(detail.rstrip(), err=True)
    sys.exit(EXIT_USAGE)


def table_console(min_width: int):
    """A rich Console for hpar's result tables: on a terminal its width, but at least
    ``min_width`` columns; written to a file or a pipe (CI, a batch job's log) 220 columns, so
    a log keeps every cell whole instead of wrapping it into ellipses."""
    from rich.console import Console

    probe = Console()
    return Console(soft_wrap=False, width=max(probe.width, min_width) if probe.is_terminal else 220)
