"""Which process of a run has stalled, from what each one says about itself.

Every worker and server prints a heartbeat line every ``HPAR_HEARTBEAT_S`` seconds from a
thread of its own (workers/report.py), carrying the run's step count it has reached. Two
kinds of stall follow from that, per process, so the process that stopped is the one named
(not the first peer whose step stopped advancing while it waits for it):

- **silent**: no line at all for ``stall_timeout`` seconds after its first heartbeat. The
  process is frozen (SIGSTOP, a host that stopped answering, a C call holding the GIL). Before
  its first heartbeat (interpreter and torch start-up) the bound is ``startup_timeout``.
- **no step**: it is alive but its step count did not advance for ``stall_timeout`` seconds
  while it trains. Start-up counts from its first step (``startup_timeout`` until then), and
  nothing counts while any process evaluates (``evaluate()`` on rank 0 keeps the others
  waiting) or after it has done its last step. Servers take no steps: only silence counts.

When several processes stall at once (peers of a stuck rank wait in a collective), the silent
one is blamed; otherwise the stacks decide (launcher/run/stacks.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass


def heartbeat_interval(stall_timeout: float) -> float:
    """Seconds between heartbeats for a run: a quarter of the stall timeout, 0.25 to 2 s."""
    return 2.0 if stall_timeout <= 0 else min(2.0, max(0.25, stall_timeout / 4))


def startup_bound(stall_timeout: float) -> float:
    """Seconds a process may take from its start to its first heartbeat and its first step
    (importing torch, joining the group, building the model): never less than 120 s."""
    return max(120.0, 4 * stall_timeout)


@dataclass
class ProcState:
    """What the launcher knows of one process (times from ``time.monotonic``)."""

    role: str
    started: float
    last_line: float | None = None      # any output: the process is not frozen
    first_beat: float | None = None
    step: int = 0
    step_time: float | None = None      # when ``step`` last advanced
    phase: str = "start"                # start | train | evaluate
    exited_cleanly: bool = False        # it announced exit code 0 (workers/report.exit_process)
    train_since: float = 0.0            # when it entered the training phase
    eval_end: float = 0.0               # when the last evaluation (of any process) ended


class Health:
    """Per-process liveness and step progress; ``stalled()`` names the processes that stalled."""

    def __init__(self, keys: list, roles: list[str], total_steps: int, stall_timeout: float):
        now = time.monotonic()
        self.total_steps, self.timeout = total_steps, stall_timeout
        self.startup = startup_bound(stall_timeout)
        self.state = {k: ProcState(role, now) for k, role in zip(keys, roles)}

    def line(self, key) -> None:
        """Any line from the process."""
        self.state[key].last_line = time.monotonic()

    def heartbeat(self, key, payload: dict) -> None:
        s = self.state[key]
        if s.first_beat is None:
            s.first_beat = time.monotonic()
        self.advance(key, payload.get("at_step"))

    def advance(self, key, step) -> None:
        """The process reports having done ``step`` steps (a heartbeat or a metric)."""
        s = self.state[key]
        if isinstance(step, int) and step > s.step:
            s.step, s.step_time = step, time.monotonic()

    def phase(self, key, phase: str) -> None:
        s = self.state[key]
        s.phase = phase
        if phase == "train":   # a resumed run's first step starts a new count, like a fresh one
            s.train_since = time.monotonic()

    def silent(self, key, now: float | None = None) -> float:
        """Seconds since the process last printed anything (or since it started)."""
        s = self.state[key]
        return (now or time.monotonic()) - (s.last_line or s.started)

    def stalled(self, alive: list) -> list[tuple[object, str]]:
        """``(key, reason)`` for every process in ``alive`` that has stalled, silent ones first."""
        if self.timeout <= 0:
            return []
        now = time.monotonic()
        silent, stuck = [], []
        evaluating = any(self.state[k].phase == "evaluate" for k in alive)
        for k in alive:
            s = self.state[k]
            if s.first_beat is None:
                if now - s.started > self.startup:
                    silent.append((k, f"stalled: no heartbeat within {self.startup:.0f} s of its start"))
                continue
            if now - (s.last_line or s.first_beat) > self.timeout:
                silent.append((k, f"stalled: silent for {self.timeout:.0f} s (--stall-timeout), "
                                  "the process is frozen or stopped"))
                continue
            if s.role != "worker" or s.phase != "train" or evaluating or s.step >= self.total_steps:
                continue
            if s.step_time is None or s.step_time < s.train_since:
                if now - (s.train_since or s.started) > self.startup:
                    stuck.append((k, f"stalled: no first step within {self.startup:.0f} s"))
            elif now - max(s.step_time, s.eval_end) > self.timeout:
                stuck.append((k, f"stalled: no step for {self.timeout:.0f} s (--stall-timeout) after step {s.step}"))
        return silent + stuck

    def evaluated(self) -> None:
        """An evaluation ended: step timers restart from now (nobody could step during it)."""
        now = time.monotonic()
        for s in self.state.values():
            s.eval_end = now
