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

- **overdue**: it has been busy with one thing outside the steps for longer than the phase
  deadline (``--phase-timeout``, default ``stall_timeout``): ``evaluate()`` (before, during and
  after training), drawing a worker's first batch, writing a checkpoint or the trained model, a
  server handling one request. Its heartbeats say what and for how long
  (strategies/common/activity.py); while a worker is busy so, its peers wait for it and their step
  clocks stand still, as during ``evaluate()``.
- **not started**: not past the rendezvous (no ``train`` or ``evaluate`` phase of a worker, no
  ``serve`` phase of a server, announced once it joined the group) within ``startup_timeout``
  of its start.

When several processes stall at once (peers of a stuck rank wait in a collective), the silent
one is blamed, then an overdue one (it knows what it is stuck in); otherwise the stacks decide
(launcher/run/stacks.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


def heartbeat_interval(stall_timeout: float, phase_timeout: float | None = None) -> float:
    """Seconds between heartbeats for a run: a quarter of the shorter of the stall and phase
    timeouts (those that are on), 0.25 to 2 s."""
    on = [t for t in (stall_timeout, phase_timeout) if t and t > 0]
    return 2.0 if not on else min(2.0, max(0.25, min(on) / 4))


def startup_bound(stall_timeout: float) -> float:
    """Seconds a process may take from its start to its first heartbeat, to the rendezvous and
    to its first step (importing torch, joining the group, building the model, loading a
    checkpoint, the first step's compute): never less than 120 s."""
    return max(120.0, 4 * stall_timeout)


@dataclass
class ProcState:
    """What the launcher knows of one process (times from ``time.monotonic``)."""

    role: str
    started: float
    last_line: float | None = None  # any output: the process is not frozen
    first_beat: float | None = None
    step: int = 0
    step_time: float | None = None  # when ``step`` last advanced
    phase: str = "start"  # start | train | evaluate (workers) | serve (servers)
    exited_cleanly: bool = False  # it announced exit code 0 (workers/report.exit_process)
    train_since: float = 0.0  # when it entered the training phase
    eval_end: float = 0.0  # when the last evaluation (of any process) ended
    doing: str | None = None  # its activity with a deadline (strategies/common/activity.py)
    doing_s: float = 0.0  # seconds it had been at it when last heard
    doing_heard: float = 0.0  # when that was

    def busy_for(self, now: float) -> float:
        """Seconds it has been at ``doing`` by now (0 when it does nothing with a deadline)."""
        return self.doing_s + now - self.doing_heard if self.doing else 0.0


# A parameter server busy with one request for longer than this holds the workers' step
# clocks: its requests take milliseconds, and a stuck one is named by the phase deadline.
SERVER_BUSY_S = 1.0
# A process that announced its clean exit is leaving (workers/report.exit_process: a flush, then
# os._exit); the launcher may see it gone seconds later on a loaded machine (a chaos test's 4 s
# --stall-timeout once named such a worker "silent"). It is a stall only after this long.
EXIT_GRACE_S = 30.0


class Health:
    """Per-process liveness and step progress; ``stalled()`` names the processes that stalled."""

    def __init__(
        self, keys: list, roles: list[str], total_steps: int, stall_timeout: float, phase_timeout: float | None = None
    ):
        now = time.monotonic()
        self.total_steps, self.timeout = total_steps, stall_timeout
        self.phase_timeout = stall_timeout if phase_timeout is None else phase_timeout
        self.phase_flag = "--stall-timeout" if phase_timeout is None else "--phase-timeout"
        self.startup = startup_bound(max(stall_timeout, self.phase_timeout))
        self.state = {k: ProcState(role, now) for k, role in zip(keys, roles)}

    def line(self, key) -> None:
        """Any line from the process."""
        self.state[key].last_line = time.monotonic()

    def heartbeat(self, key, payload: dict) -> None:
        s = self.state[key]
        if s.first_beat is None:
            s.first_beat = time.monotonic()
        self.advance(key, payload.get("at_step"))
        self.activity(key, payload.get("doing"), payload.get("doing_s") or 0.0)

    def activity(self, key, what: str | None, seconds: float = 0.0) -> None:
        """The process is busy with ``what`` for ``seconds`` so far (a heartbeat's ``doing``, or
        an announcement of a change); None: nothing with a deadline. When a worker's activity
        ends, the other workers' step clocks start again (they were waiting for it)."""
        s, now = self.state[key], time.monotonic()
        if s.doing and what is None and s.role == "worker":
            self.evaluated()
        s.doing, s.doing_s, s.doing_heard = what, float(seconds), now

    def advance(self, key, step) -> None:
        """The process reports having done ``step`` steps (a heartbeat or a metric)."""
        s = self.state[key]
        if isinstance(step, int) and step > s.step:
            s.step, s.step_time = step, time.monotonic()

    def phase(self, key, phase: str) -> None:
        s = self.state[key]
        s.phase = phase
        if phase == "train":  # a resumed run's first step starts a new count, like a fresh one
            s.train_since = time.monotonic()

    def silent(self, key, now: float | None = None) -> float:
        """Seconds since the process last printed anything (or since it started)."""
        s = self.state[key]
        return (now or time.monotonic()) - (s.last_line or s.started)

    def stalled(self, alive: list) -> list[tuple[object, str]]:
        """``(key, reason)`` for every process in ``alive`` that has stalled: silent ones first,
        then overdue ones (stuck in an activity with a deadline), then the others."""
        if self.timeout <= 0 and self.phase_timeout <= 0:
            return []
        now = time.monotonic()
        silent, overdue, stuck = [], [], []
        # peers wait while a worker evaluates or does something else with a deadline of its own,
        # and while a parameter server is stuck in one request (their steps wait for its answer;
        # it is the one to name when its deadline passes)
        waiting = any(
            self.state[k].phase == "evaluate"
            or (self.state[k].doing and self.state[k].role == "worker")
            or (self.state[k].role == "server" and self.state[k].busy_for(now) > SERVER_BUSY_S)
            for k in alive
        )
        for k in alive:
            s = self.state[k]
            if s.first_beat is None:
                if now - s.started > self.startup:
                    silent.append((k, f"stalled: no heartbeat within {self.startup:.0f} s of its start"))
                continue
            if s.exited_cleanly:
                if now - (s.last_line or s.first_beat) > EXIT_GRACE_S:
                    silent.append((k, f"stalled: still running {EXIT_GRACE_S:.0f} s after it announced its exit"))
                continue
            if self.timeout > 0 and now - (s.last_line or s.first_beat) > self.timeout:
                silent.append(
                    (k, f"stalled: silent for {self.timeout:.0f} s (--stall-timeout), the process is frozen or stopped")
                )
                continue
            if self.phase_timeout > 0 and s.busy_for(now) > self.phase_timeout:
                overdue.append(
                    (
                        s.busy_for(now),
                        k,
                        f"stalled: {s.doing} for more than {self.phase_timeout:.0f} s ({self.phase_flag})",
                    )
                )
                continue
            if s.phase == "start" and not s.doing and s.role in ("worker", "server"):
                if now - s.started > self.startup:
                    stuck.append((k, f"stalled: not at the rendezvous within {self.startup:.0f} s of its start"))
                continue
            if self.timeout <= 0 or s.role != "worker" or s.phase != "train" or waiting or s.step >= self.total_steps:
                continue
            if s.step_time is None or s.step_time < s.train_since:
                if now - (s.train_since or s.started) > self.startup:
                    stuck.append((k, f"stalled: no first step within {self.startup:.0f} s"))
            elif now - max(s.step_time, s.eval_end) > self.timeout:
                stuck.append((k, f"stalled: no step for {self.timeout:.0f} s (--stall-timeout) after step {s.step}"))
        return silent + [(k, why) for _, k, why in sorted(overdue, key=lambda o: -o[0])] + stuck

    def hanging(self, alive: list) -> bool:
        """Whether a process of ``alive`` has been silent, busy with one thing outside the steps,
        or a training worker without a step, for 5 s or more (Ctrl-C then takes the stacks first)."""
        now = time.monotonic()
        for k in alive:
            s = self.state[k]
            if s.first_beat is not None and (
                self.silent(k, now) > 5
                or s.busy_for(now) > 5
                or (
                    s.role == "worker"
                    and s.phase == "train"
                    and s.step_time
                    and now - s.step_time > 5
                    and s.step < self.total_steps
                )
            ):
                return True
        return False

    def evaluated(self) -> None:
        """An evaluation (or another worker's activity with a deadline) ended: step timers
        restart from now (nobody could step during it)."""
        now = time.monotonic()
        for s in self.state.values():
            s.eval_end = now
