"""The processes a process of the run started that left its process group, and ending them.

hpar stops a run by its recorded process groups (workers/guard.py leads one per worker or
server, workers/stopgroups.py signals them on a host). A process the user's code starts in a
session of its own (``subprocess.Popen(..., start_new_session=True)``, as some data loaders and
tokenizer servers do) is in none of them: it is found here from the process tree, as a live
descendant of a process hpar started (the guard, which is their subreaper, or the launcher
itself, whose pre-start checks run the user's ``data()`` and ``model()``), whose process group
is not that process's. Nothing is ever found by name. Ending one is SIGTERM (and SIGCONT, so
that a stopped one acts on it), ``grace`` seconds, SIGKILL; what was ended is described in
one line, as the launcher reports it.
"""

from __future__ import annotations

import os
import signal

import psutil


def outside_group(root: int, pgid: int) -> list[psutil.Process]:
    """The live (not zombie) descendants of process ``root`` that are not in process group
    ``pgid`` ([] when ``root`` is gone)."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for p in children:
        try:
            if os.getpgid(p.pid) != pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def describe(p: psutil.Process, arg_width: int = 32, width: int = 100) -> str:
    """``PID (command line)``, each argument cut to ``arg_width`` characters (a ``-c`` program),
    the whole to ``width``."""
    try:
        cmd = " ".join(_cut(a, arg_width) for a in p.cmdline()) or p.name()
    except psutil.Error:
        cmd = "?"
    return f"{p.pid} ({_cut(cmd, width)})"


def send(procs: list[psutil.Process], sig: int) -> None:
    """Send ``sig`` to each of ``procs`` still alive (psutil checks that a pid was not reused)."""
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            continue


def end(procs: list[psutil.Process], grace: float = 1.0) -> list[str]:
    """SIGTERM and SIGCONT to ``procs``, up to ``grace`` s for them to go, SIGKILL to the rest
    (and up to 2 s more); returns their descriptions (:func:`describe`), taken first."""
    if not procs:
        return []
    described = [describe(p) for p in procs]
    send(procs, signal.SIGTERM)
    send(procs, signal.SIGCONT)
    _, alive = psutil.wait_procs(procs, timeout=grace)
    if alive:
        send(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=2.0)
    return described


def ended_line(ended: dict[str, list[str]]) -> str | None:
    """The launcher's one line naming what was ended, by who had started it
    (``{"worker 0": ["6947 (python -c ...)"]}``); None when nothing was."""
    parts = [f"{who}: {', '.join(items)}" for who, items in ended.items() if items]
    if not parts:
        return None
    n = sum(len(items) for items in ended.values())
    return f"hpar: ended {n} process(es) left running in a session of their own; " + "; ".join(parts)
