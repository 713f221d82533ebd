"""The processes of a run, an `hpar run` in the background, and waiting for a condition: shared
by scripts/chaos.py and the tests (tests/conftest.py), which both check that a run leaves
nothing behind.

A process belongs to the run in RUN_DIR when its environment has ``HPAR_CONFIG`` =
RUN_DIR/config.json: the launcher gives it to every worker and server and their guards, on this
machine and on other hosts (over SSH; the test hosts of scripts/testhosts.py are network
namespaces of this machine, so their processes are found here too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil


def run_processes(run_dir: str) -> list[psutil.Process]:
    """Every live (not zombie) process started for the run in ``run_dir``."""
    want = os.path.join(os.path.abspath(run_dir), "config.json")
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("HPAR_CONFIG") == want and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_for(predicate, timeout: float, interval: float = 0.1):
    """Poll ``predicate`` every ``interval`` s until it returns something truthy or ``timeout``
    s pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


class Launcher:
    """One `hpar run` in the background; its output lines are kept with their arrival times."""

    def __init__(self, args: list[str], log: str):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hpar.launcher.cli", "run", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.log = open(log, "a")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))
            self.log.write(line)
        self.log.flush()

    def first_line(self, *needles: str) -> float | None:
        return next((t for t, line in list(self.lines) if any(n in line for n in needles)), None)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
