"""``python -m hpar.workers.stopgroups [--grace S] [--kill-wait S] PGID...``: stop process groups on
this host, all at once, for the launcher's teardown (launcher/run/teardown.py runs it over SSH,
one command per host, instead of one connection per process and round).

It sends SIGTERM and SIGCONT to every group named (SIGCONT so that a stopped process acts on the
SIGTERM at once), waits until every group is gone or ``--grace`` seconds pass, sends SIGKILL to the
groups still alive and waits up to ``--kill-wait`` seconds more. It then prints one line,
``@hpar left PGID...`` (nothing after ``left`` when every group is gone), and exits 0 when
nothing is left, 1 otherwise. Only the groups named are signalled (the launcher recorded them
when it started them: each is a guard's group, workers/guard.py), never processes found by name;
a group id below 2 is refused (exit 2). It polls every 50 ms with signal 0 to each group (no
scan of the process table), and every 0.5 s and before it reports tells a group of zombies only
from a live one from ``/proc/PID/stat`` (Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

POLL_S = 0.05


def alive_groups(groups: set[int], proc: str = "/proc") -> set[int]:
    """The members of ``groups`` (process group ids) that still have a live, non-zombie process,
    from ``PROC/PID/stat`` (field 3 the state, field 5 the process group)."""
    alive = set()
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != b"Z" and int(fields[2]) in groups:
            alive.add(int(fields[2]))
    return alive


def _send(sig: int, groups: set[int]) -> None:
    for g in groups:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _signalable(groups: set[int]) -> set[int]:
    """The members of ``groups`` that still exist (signal 0: one system call per group, not a
    scan of /proc; a zombie still counts)."""
    out = set()
    for g in groups:
        try:
            os.killpg(g, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        out.add(g)
    return out


def _wait_gone(groups: set[int], seconds: float) -> set[int]:
    """Poll until no process of ``groups`` exists or ``seconds`` pass; the groups with a live
    (not zombie) process then."""
    deadline, polls = time.monotonic() + seconds, 0
    left = _signalable(groups)
    while left and time.monotonic() < deadline:
        time.sleep(POLL_S)
        polls += 1
        # every 10th poll, look closer: a group whose processes are all zombies (a parent outside
        # the group has not reaped them yet) is gone
        left = alive_groups(left) if polls % 10 == 0 else _signalable(left)
    return alive_groups(left) if left else left


def escaped(groups: set[int]) -> dict[int, list]:
    """Per group, the live descendants of its leader (the guard: its pid is the group id) that
    left the group (workers/descendants.py), found before anything is signalled: once the guard
    is gone they are init's children and no longer anyone's of the run."""
    from hpar.workers.descendants import outside_group

    return {g: found for g in sorted(groups) if (found := outside_group(g, g))}


def stop_groups(groups: set[int], grace: float, kill_wait: float, ended: dict | None = None) -> set[int]:
    """SIGTERM + SIGCONT to ``groups`` and to what their processes started in sessions of their
    own, up to ``grace`` s for them to go, SIGKILL to the rest, up to ``kill_wait`` s more;
    returns the groups still alive (empty: nothing left). ``ended`` (a dict) receives, per
    group, the descriptions of the processes outside it that were stopped. Raises ValueError
    for a group id below 2 (0 and 1 would be this process's group or init's)."""
    from hpar.workers.descendants import describe, send

    bad = [g for g in groups if g < 2]
    if bad:
        raise ValueError(f"refusing process group {bad[0]}")
    extra = escaped(groups)
    if ended is not None:
        ended.update({g: [describe(p) for p in procs] for g, procs in extra.items()})
    outside = [p for procs in extra.values() for p in procs]
    _send(signal.SIGTERM, groups)
    send(outside, signal.SIGTERM)
    _send(signal.SIGCONT, groups)
    send(outside, signal.SIGCONT)
    deadline = time.monotonic() + grace
    left = _wait_gone(groups, grace)
    if outside:
        import psutil

        outside = psutil.wait_procs(outside, timeout=max(0.0, deadline - time.monotonic()))[1]
        send(outside, signal.SIGKILL)
    if left:
        _send(signal.SIGKILL, left)
        left = _wait_gone(left, kill_wait)
    return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpar.workers.stopgroups", description=__doc__.splitlines()[0])
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--kill-wait", type=float, default=5.0)
    parser.add_argument("pgids", type=int, nargs="+")
    args = parser.parse_args(argv)
    ended: dict[int, list[str]] = {}
    try:
        left = stop_groups(set(args.pgids), args.grace, args.kill_wait, ended)
    except ValueError as exc:
        print(f"stopgroups: {exc}", file=sys.stderr)
        return 2
    if ended:
        print("@hpar ended " + json.dumps({str(g): items for g, items in ended.items()}), flush=True)
    print("@hpar left " + " ".join(str(g) for g in sorted(left)), flush=True)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
