"""Watch every process of a run and stop them all at the first failure.

The supervisor reads the output of every process from one queue (see launcher/procs/local.py),
writes each line to that process's log, turns tagged ``@hpar`` lines into metrics and live
progress, and polls exit codes. The first failure (a non-zero exit, a death by signal, a
process that made no progress for ``stall_timeout`` seconds, or Ctrl-C/SIGTERM to the launcher)
stops every other process: SIGTERM to each recorded process group, ``grace`` seconds, then
SIGKILL. The failure is reported with host, process, cause and the last lines of its log.
Outside the steps (``evaluate()``, a worker's first batch, checkpoint and model writes, a
server's request) a process that stays busy past ``phase_timeout`` stalls too.

Stalls are told per process (launcher/run/health.py); before a stalled run is torn down every
process's Python stack is taken and summarised (launcher/run/stacks.py), then the stalled
process gets SIGKILL at once (a frozen process cannot act on SIGTERM) and the others the usual
SIGTERM round. A worker that exits 0 without having finished (``sys.exit(0)`` in the user's
code) is a failure of its own, not its peers'.
"""

from __future__ import annotations

import queue
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hpar.launcher.run import teardown
from hpar.launcher.run.blame import PEER_LOST, blame_order, describe_exit, lost_host
from hpar.launcher.run.health import Health
from hpar.launcher.run.progress import Progress
from hpar.launcher.run.rundir import RunDir
from hpar.launcher.run.stall_check import StallDiagnosis
from hpar.workers import report

EXIT_FAILED, EXIT_REFUSED, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 143


@dataclass
class Outcome:
    """How a run ended: the launcher's exit code, the process that failed first (label,
    host) and why, and rank 0's summary when training finished."""

    exit_code: int
    failed: str | None = None
    host: str | None = None
    cause: str | None = None
    summary: dict | None = None
    unused: bool = False  # a DDP step left a parameter without a gradient: ``cause`` says it (runner.py)


def _start(p) -> Exception | None:
    """Start ``p``; the exception instead of raising it."""
    try:
        p.start()
    except Exception as exc:
        return exc
    return None


class Supervisor(StallDiagnosis):
    """Runs ``procs`` (objects with LocalProcess's methods) to completion or first failure."""

    def __init__(
        self,
        procs: list,
        lines: "queue.Queue",
        rundir: RunDir,
        progress: Progress,
        stall_timeout: float = 0.0,
        grace: float = 5.0,
        total_steps: int = 0,
        on_event=None,
        phase_timeout: float | None = None,
    ):
        self.procs, self.lines, self.rundir, self.progress = procs, lines, rundir, progress
        self.stall_timeout, self.grace = stall_timeout, grace
        self.summary: dict | None = None
        self.on_event = on_event  # called with (proc, event payload) for every event line
        self._signal_of: dict[int, int] = {}
        self._peer_lost: set[int] = set()  # processes whose output says a peer vanished
        self._exit_seen: dict[int, int] = {}  # order in which exits were seen
        self.health = Health(
            [id(p) for p in procs], [p.spec.role for p in procs], total_steps, stall_timeout, phase_timeout
        )
        self._stacks: dict[int, list[str]] | None = None  # dumps being read back, by process
        self._eof: set[int] = set()  # processes whose output has ended
        self._stop_signal: int | None = None
        self._stopped = False
        self._ended: dict[str, list[str]] = {}  # by process label: what its guard ended outside its group
        self._refused: tuple | None = None  # (process, message, unused): refused its input, or DDP an unused parameter

    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum

    def run(self) -> Outcome:
        """Start every process and supervise; always leaves no process of the run behind."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            if not self._stopped:  # _fail stops everything before it reports
                self.teardown()
            self._say_ended()
            self.progress.mark_stopped()  # the live view's final state: no row left "running"
            for s, h in old.items():
                signal.signal(s, h)

    def _run(self) -> Outcome:
        # every start at once: a remote one is a channel on its host's connection (opened by the
        # preflight, launcher/procs/ssh_pool.py), whose cost must not add up over the hosts
        with ThreadPoolExecutor(max_workers=max(1, min(256, len(self.procs)))) as pool:
            errors = list(pool.map(_start, self.procs))
        for p, exc in zip(self.procs, errors):
            if exc is not None:  # e.g. SSH refused after preflight
                self.progress.say(f"hpar: could not start {p.spec.label} on {p.spec.host}: {exc}")
                return Outcome(EXIT_FAILED, p.spec.label, p.spec.host, f"could not start: {exc}")
            self.health.state[id(p)].started = time.monotonic()
        exited: dict[int, int] = {}
        while True:
            self._drain(timeout=0.2)
            if self._refused:  # a worker refused its first batch: stop everyone now (strategies/job/first_batch.py)
                return self._fail(self._refused[0], self._refused[1])
            if self._stop_signal is not None:
                name = signal.Signals(self._stop_signal).name
                self.progress.say(f"hpar: {name} received, stopping every process")
                if self.health.hanging([id(p) for p in self.procs if p.poll() is None]):
                    self._diagnose()  # Ctrl-C on a hung run: say where every process stands
                return Outcome(
                    EXIT_INTERRUPTED if self._stop_signal == signal.SIGINT else EXIT_TERMINATED,
                    cause=f"launcher received {name}",
                )
            failed, newly = [], []
            for p in self.procs:
                code = p.poll()
                if code is not None and id(p) not in exited:
                    exited[id(p)] = code
                    self._exit_seen.setdefault(id(p), len(self._exit_seen))
                    newly.append((p, code))
            # read their last lines (the exit events) first, one deadline for all of them; an
            # srun task's output shares the step's stream (no end of file of its own) and may
            # lag its exit status
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and any(
                code == 0 and id(p) not in self._eof and not self.health.state[id(p)].exited_cleanly
                for p, code in newly
            ):
                self._drain(timeout=0.05)
            for p, code in newly:
                early = code == 0 and self._is_hpar(p) and not self.health.state[id(p)].exited_cleanly
                self.progress.update(p.spec.label, "state", {"state": "done" if code == 0 and not early else "failed"})
                if early:
                    return self._fail(
                        p, "exited with code 0 before the end of training (sys.exit(0) or os._exit(0) in the script?)"
                    )
                if code != 0:
                    failed.append(p)
            if failed:
                # a peer's crash makes the others fail too (gloo aborts them with SIGABRT on a
                # closed connection): wait for the exits still in flight, blame the root cause;
                # no wait when a failure is already a root cause (outside signal, lost host)
                if not any(self._is_root_cause(p) for p in failed):
                    time.sleep(1.0)
                    self._drain(timeout=0.0)
                candidates = failed + [p for p in self.procs if id(p) not in exited and p.poll() not in (None, 0)]
                for p in candidates:
                    self._exit_seen.setdefault(id(p), len(self._exit_seen))
                first = min(candidates, key=lambda p: (self._blame_order(p), self._exit_seen[id(p)]))
                if first.host_lost:  # the link, the host or its sshd: its guards stop their groups there
                    return self._fail(first, lost_host(first.spec.host, getattr(first, "lost_how", None)))
                return self._fail(first, describe_exit(first.poll(), self._signal_of.get(id(first))))
            if len(exited) == len(self.procs):
                self._drain_to_end(2.0)  # the guards' last lines: what they ended outside their groups
                return Outcome(0, summary=self.summary)
            stalled = self.health.stalled([id(p) for p in self.procs if id(p) not in exited])
            if stalled:
                return self._stall(stalled)

    @staticmethod
    def _is_hpar(p) -> bool:
        """Whether ``p`` runs hpar's own worker or server (which announce a clean exit). Not
        for a task of a Slurm step: srun may drop a task's last output lines when it exits, so
        a missing exit event there proves nothing (its exit status still counts)."""
        from hpar.launcher.procs.srun import SrunProcess

        return not isinstance(p, SrunProcess) and any(
            a in ("hpar.workers.worker", "hpar.workers.server") for a in p.spec.argv
        )

    def _drain_to_end(self, seconds: float) -> None:
        """Read output until every process's own stream has ended (not an srun task's: the
        step's stream is shared), ``seconds`` at most."""
        from hpar.launcher.procs.srun import SrunProcess

        deadline = time.monotonic() + seconds
        self._drain(timeout=0.0)
        while time.monotonic() < deadline and any(
            id(p) not in self._eof and not isinstance(p, SrunProcess) for p in self.procs
        ):
            self._drain(timeout=0.05)

    def _say_ended(self) -> None:
        """One line naming what was ended of the processes the run's processes had started in
        sessions of their own: by their guards when they exited, or with their groups."""
        from hpar.workers.descendants import ended_line

        for p in self.procs:
            for pid, item in getattr(p, "ended", {}).items():
                if not any(i.split()[0] == str(pid) for i in self._ended.get(p.spec.label, [])):
                    self._ended.setdefault(p.spec.label, []).append(item)
        line = ended_line({f"started by {label}": items for label, items in self._ended.items()})
        if line:
            self.progress.say(line)

    def _is_root_cause(self, p) -> bool:
        """A failure nothing else can have caused: a signal from outside, a lost host."""
        return self._blame_order(p) == 0 or p.host_lost

    def _blame_order(self, p) -> int:  # launcher/run/blame.py: 0 for the likeliest root cause
        return blame_order(p.poll(), self._signal_of.get(id(p)), id(p) in self._peer_lost)

    def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                proc, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if line is not None:
                self._handle(proc, line)
            else:
                self._eof.add(id(proc))

    def _handle(self, proc, line: str) -> None:
        spec = proc.spec
        self.rundir.log_line(spec.log_name, line)
        self.health.line(id(proc))
        parsed = report.parse(line)
        if parsed is None and any(m in line for m in PEER_LOST):
            self._peer_lost.add(id(proc))
        if parsed is None:
            if self._stacks is not None and id(proc) in self._stacks:
                self._stacks[id(proc)].append(line)  # a stack dump: to RUN_DIR/stacks, not the screen
            elif not self._refused:  # after a refusal, the peers' complaints go to their logs only
                self.progress.say(f"[{spec.host} {spec.label}] {line}")
            return
        kind, payload = parsed
        if kind in ("metric", "heartbeat"):
            self.rundir.metric(
                {"kind": kind, "role": spec.role, "rank": spec.rank, "host": spec.host, "time": time.time(), **payload}
            )
            self.progress.update(spec.label, kind, payload)
            if kind == "metric":
                self.health.advance(id(proc), payload.get("step"))
            else:
                self.health.heartbeat(id(proc), payload)
        elif kind == "eval":  # evaluate() during training (--eval-every), worker 0
            self.rundir.metric(
                {"kind": kind, "role": spec.role, "rank": spec.rank, "host": spec.host, "time": time.time(), **payload}
            )
            shown = ", ".join(f"{k} {v:.4g}" for k, v in payload.items() if k != "step" and isinstance(v, (int, float)))
            self.progress.say(f"hpar: evaluate at step {payload.get('step')}: {shown}")
            self.health.evaluated()  # nobody could step meanwhile
        elif kind == "summary":
            self.summary = payload
        elif kind == "event":
            what = payload.get("kind")
            if what == "signal":
                self._signal_of[id(proc)] = int(payload["signal"])
            elif what == "phase":
                if self.health.state[id(proc)].phase == "evaluate":
                    self.health.evaluated()
                self.health.phase(id(proc), payload.get("phase", ""))
            elif what == "doing":  # strategies/common/activity.py: a worker's change of activity, seen at once
                self.health.activity(id(proc), payload.get("what"))
            elif what in ("refused", "unused"):  # unused: strategies/runtimes/dataparallel/ddp.py, said by runner.py
                self._refused = self._refused or (proc, str(payload.get("message")), what == "unused")
            elif what == "ended" and isinstance(payload.get("processes"), list):  # workers/guard.py
                self._ended.setdefault(spec.label, []).extend(str(x) for x in payload["processes"])
            elif what == "exit" and payload.get("code") == 0:
                self.health.state[id(proc)].exited_cleanly = True
            if self.on_event is not None:
                self.on_event(proc, payload)

    def _fail(self, p, cause: str) -> Outcome:
        self.teardown()
        self._drain(timeout=0.2)
        if self._refused:  # the user's input, refused before training: one line, as before start (exit 2)
            if not self._refused[2]:
                self.progress.say(f"hpar: {self._refused[1]}")
            return Outcome(EXIT_REFUSED, p.spec.label, p.spec.host, self._refused[1], self.summary, self._refused[2])
        tail = [t for t in self.rundir.tail(p.spec.log_name, 20) if not t.startswith(report.TAG)][
            -10:
        ]  # the process's own words
        self.progress.say(f"hpar: {p.spec.label} on {p.spec.host} failed: {cause}; stopped every other process")
        if tail:
            self.progress.say(f"hpar: last lines of {p.spec.log_name}:\n" + "\n".join("  " + t for t in tail))
        elif self.rundir.tail(p.spec.log_name, 1):
            self.progress.say(f"hpar: {p.spec.log_name} holds no line of the process's own, only hpar's reports")
        return Outcome(EXIT_FAILED, p.spec.label, p.spec.host, cause, self.summary)

    def teardown(self) -> None:
        """Stop every recorded process group still alive, on every host at once (SIGTERM and
        SIGCONT, so that a stopped process acts on it, ``grace`` s, SIGKILL, up to 5 s more),
        returning as soon as nothing is left: one command per remote host, not one SSH
        connection per process and round (launcher/run/teardown.py)."""
        left = teardown.stop_all(self.procs, self.grace)
        for host, labels in left.items():
            self.progress.say(f"hpar: could not confirm that {', '.join(labels)} on {host} stopped")
        for p in self.procs:
            p.close_stdin()
        self._stopped = True
