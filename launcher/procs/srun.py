"""Processes inside a Slurm allocation, started with ``srun``: one job step for the whole run,
one task per process, hpar's guard around every process; ``SrunProcess`` offers exactly the
methods and attributes of ``LocalProcess`` (launcher/procs/local.py).

The step is ``srun --ntasks N --distribution=arbitrary --label --input=all --kill-on-bad-exit=0
--overcommit --overlap PY -c BOOT TASKS.json``: ``SLURM_HOSTFILE`` names each task's node (task
i is ProcessSpec i), and BOOT, in every task, reads its entry of ``TASKS.json`` (run dir, so on
the shared filesystem like ``config.json``), sets its environment and working directory, and
runs the guard as the leader of a new session (``setsid``), as over SSH. It then prints
``@hpar event {"kind":"exit","code":C}`` and exits with the guard's code (128+N for signal N).

- Secrets: ``TASKS.json`` holds each task's argv and hpar's own variables only (``RANK``, ...); it
  is created 0600 and removed once every task's guard has started (or srun has ended). The
  ``--env`` values and the forwarded allowlist reach the tasks in srun's own environment
  (:func:`step_environment`, exported with ``--export=ALL``), in memory, never in a file.

- Output: srun's ``--label`` puts ``N: `` before task N's lines; one reader splits them per task.
- Liveness: the launcher writes a byte a second to srun's stdin, which ``--input=all`` copies to
  every task: a guard that sees EOF (launcher gone) or ``HEARTBEAT_S`` of silence stops its group.
- Signals: ``scancel --signal=SIG JOB.STEP`` reaches every process of the step (Slurm tracks
  them with its proctrack plugin, whatever their session); a failure stops the whole run
  anyway, so signalling one task signals the step. Slurm kills whatever is left when the step
  ends.
- Exit codes: the BOOT's exit event (task 0's BOOT also names the step, ``JOB.STEP``); else srun's own ``task N: Exited with exit code C`` /
  ``Killed`` lines; else, once srun has ended, srun's exit code.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal as signals
import subprocess
import sys
import threading
import time

from hpar.launcher.procs.local import ProcessSpec
from hpar.launcher.procs.srun_tasks import srun_argv, step_environment, task_table, write_private
from hpar.strategies.state.checkpoint import atomic_write_bytes

_LABEL = re.compile(r"^\s*([0-9]+): ?(.*)$")
_TASK_END = re.compile(r"task[s]? ([0-9,\-]+): (Exited with exit code ([0-9]+)|Killed|Terminated|.*)")


class SrunStep:
    """One srun step running every ``ProcessSpec`` of a run; ``processes`` are its tasks."""

    def __init__(
        self,
        specs: list[ProcessSpec],
        lines: "queue.Queue",
        run_dir: str,
        python: str | None = None,
        env: dict | None = None,
        cwd: str | None = None,
    ):
        self.specs, self.lines, self.run_dir = specs, lines, run_dir
        self.python = python or sys.executable
        self.env = env
        self.cwd = cwd or os.getcwd()
        self.processes = [SrunProcess(self, i, spec) for i, spec in enumerate(specs)]
        self._popen: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.step_id: str | None = None
        self._signalled: dict[int, float] = {}
        self.tasks_file = os.path.join(run_dir, "srun-tasks.json")

    def remove_tasks_file(self) -> None:
        """Remove ``srun-tasks.json`` once every task has read it: each task's guard has started
        (its BOOT read the file before), or srun has ended. No-op before then or when gone."""
        if not (self._done.is_set() or all(p.pgid is not None for p in self.processes)):
            return
        try:
            os.unlink(self.tasks_file)
        except FileNotFoundError:
            pass

    def start(self) -> None:
        """Write the task table and host file, start srun (once; later calls do nothing)."""
        with self._lock:
            if self._popen is not None:
                return
            tasks_file = self.tasks_file
            hostfile = os.path.join(self.run_dir, "srun-hosts.txt")
            write_private(tasks_file, json.dumps(task_table(self.specs, self.env, self.cwd)).encode())
            atomic_write_bytes(hostfile, "".join(s.host + "\n" for s in self.specs).encode())
            env = dict(step_environment(self.env), SLURM_HOSTFILE=hostfile)
            self._popen = subprocess.Popen(
                srun_argv(len(self.specs), tasks_file, self.python),
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                cwd=self.cwd,
            )
            for target, name in ((self._read_out, "out"), (self._read_err, "err"), (self._heartbeat, "beat")):
                threading.Thread(target=target, name=f"hpar-srun-{name}", daemon=True).start()

    def _read_out(self) -> None:
        assert self._popen is not None and self._popen.stdout is not None
        for raw in self._popen.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            m = _LABEL.match(line)
            task = int(m.group(1)) if m else None
            if task is None or task >= len(self.processes):
                self.lines.put((self.processes[0], f"[srun] {line}"))
                continue
            self.processes[task]._line(m.group(2))
        self._popen.wait()
        self._done.set()
        self.remove_tasks_file()
        for p in self.processes:
            p._finish(self._popen.returncode)

    def _read_err(self) -> None:
        """srun's own messages: task ends (``task 3: Killed``), the step id; all go to the logs."""
        assert self._popen is not None and self._popen.stderr is not None
        for raw in self._popen.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            m = _LABEL.match(line)
            if m and int(m.group(1)) < len(self.processes):  # a task's stderr
                self.processes[int(m.group(1))]._line(m.group(2))
                continue
            end = _TASK_END.search(line)
            targets = self.processes[:1]
            if end and "srun" in line:
                targets = [self.processes[t] for t in _task_numbers(end.group(1)) if t < len(self.processes)]
                for p in targets:
                    p._srun_end(end.group(2), end.group(3))
            for p in targets:
                self.lines.put((p, f"[srun] {line}"))

    def _heartbeat(self) -> None:
        """One byte a second on srun's stdin, which --input=all copies to every guard."""
        assert self._popen is not None and self._popen.stdin is not None
        stdin = self._popen.stdin
        while not self._done.wait(1.0):
            try:
                stdin.write(b"\n")
                stdin.flush()
            except (OSError, ValueError):
                return

    def running(self) -> bool:
        """True from start until srun has exited (every task ended, the step cleaned up)."""
        return self._popen is not None and self._popen.poll() is None

    def signal(self, sig: int) -> None:
        """``sig`` to every process of the step (scancel), at most once a second per signal."""
        if not self.running():
            return
        now = time.monotonic()
        with self._lock:
            if now - self._signalled.get(sig, -10.0) < 1.0:
                return
            self._signalled[sig] = now
        if self.step_id:
            name = signals.Signals(sig).name.removeprefix("SIG")
            subprocess.run(
                [shutil.which("scancel") or "scancel", f"--signal={name}", self.step_id],
                capture_output=True,
                env=step_environment(self.env),
                timeout=30,
            )
        elif self._popen is not None:  # step id not known yet: srun forwards SIGTERM/SIGKILL to its tasks
            try:
                os.killpg(self._popen.pid, sig)
            except ProcessLookupError:
                pass

    def close_stdin(self) -> None:
        """Close srun's stdin: every guard sees EOF and stops its group."""
        self._done.set()
        if self._popen is not None and self._popen.stdin is not None:
            try:
                self._popen.stdin.close()
            except OSError:
                pass


def _task_numbers(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            out.extend(range(int(low), int(high or low) + 1))
    return out


class SrunProcess:
    """Task ``index`` of an SrunStep, with LocalProcess's interface (start, poll, signal,
    terminate, kill, group_alive, close_stdin; spec, pid, pgid, host_lost)."""

    def __init__(self, step: SrunStep, index: int, spec: ProcessSpec):
        self.step, self.index, self.spec = step, index, spec
        self.pid: int | None = None
        self.pgid: int | None = None
        self.host_lost = False
        self._code: int | None = None

    def start(self) -> None:
        """Start the step (the first task's call starts it; the others find it running)."""
        self.step.start()

    def _line(self, line: str) -> None:
        if line.startswith("@hpar event "):
            try:
                event = json.loads(line[len("@hpar event ") :])
            except ValueError:
                event = {}
            if event.get("kind") == "started" and isinstance(event.get("pgid"), int) and self.pgid is None:
                self.pid = self.pgid = event["pgid"]
                self.step.remove_tasks_file()  # this task's BOOT has read it; gone once all have
            elif event.get("kind") == "exit" and isinstance(event.get("code"), int):
                self._set(event["code"])
                return
            elif event.get("kind") == "step" and isinstance(event.get("step"), str):
                self.step.step_id = event["step"]
                return
        self.step.lines.put((self, line))

    def _set(self, code: int) -> None:
        if self._code is None:
            self._code = -(code - 128) if 128 < code < 128 + 65 else code

    def _srun_end(self, how: str, code: str | None) -> None:
        if code is not None:
            self._set(int(code))
        elif how.startswith("Killed"):
            self._set(128 + signals.SIGKILL)
        elif how.startswith("Terminated"):
            self._set(128 + signals.SIGTERM)

    def _finish(self, srun_code: int) -> None:
        self._set(0 if srun_code == 0 else (srun_code if srun_code > 0 else 128 - srun_code))
        self.step.lines.put((self, None))

    def poll(self) -> int | None:
        """Exit code; None while running; -N when it (or its guard) died of signal N."""
        return self._code

    def signal(self, sig: int) -> None:
        """``sig`` to the whole step (see the module docstring); no-op once it ended."""
        self.step.signal(sig)

    def terminate(self) -> None:
        self.signal(signals.SIGTERM)

    def kill(self) -> None:
        self.signal(signals.SIGKILL)

    def group_alive(self) -> bool:
        """True while the step runs: srun ends only once every task has ended and Slurm has
        killed what was left of the step's processes."""
        return self.step.running()

    def close_stdin(self) -> None:
        self.step.close_stdin()
