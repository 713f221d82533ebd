"""What the supervisor (launcher/run/supervisor.py) does when a run stalls: take every live
process's Python stack (SIGUSR1 and its faulthandler dump, launcher/run/stacks.py), write them
to RUN_DIR/stacks/, print their summary, and blame one process: the silent one, one that gave
no stack while others did, or the one found elsewhere than in torch while its peers wait there."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from hpar.launcher.run import stacks
from hpar.launcher.run.blame import lost_host


class StallDiagnosis:
    """The supervisor's stall handling, mixed into ``Supervisor``: it reads the supervisor's
    ``procs``, ``health``, ``progress``, ``rundir`` and ``stall_timeout`` and calls its
    ``_drain`` and ``_fail``."""

    def _stall(self, stalled: list):
        """Take every process's stack, blame the stalled process (the silent one, else the one
        found elsewhere than in torch while its peers wait there), SIGKILL it, stop the rest;
        returns the run's Outcome (launcher/run/supervisor.py), as ``_fail`` makes it."""
        by_id, by_label = {id(p): p for p in self.procs}, {p.spec.label: p for p in self.procs}
        odd, mute = self._diagnose()
        lost = [p for p in self.procs if p.host_lost]
        if lost:  # silent because its host is cut off (found while the stacks were asked for)
            return self._fail(lost[0], lost_host(lost[0].spec.host, getattr(lost[0], "lost_how", None)))
        key, cause = stalled[0]
        # a silent process, or one stuck past the phase deadline in what it said it was doing, is
        # the culprit whatever the stacks show; otherwise the stacks decide
        if not cause.startswith("stalled: silent") and not self.health.state[key].doing:
            if mute:  # gave no stack while others did: stopped or frozen
                key = id(by_label[mute[0]])
                cause = (
                    f"stalled: silent for {self.health.silent(key):.0f} s and no answer to the stack "
                    "request (stopped or frozen)"
                )
            elif len(odd) == 1:
                key, cause = (
                    id(by_label[odd[0]]),
                    (
                        f"stalled: not in a collective while its peers wait in one "
                        f"(no step for {self.stall_timeout:.0f} s, --stall-timeout)"
                    ),
                )
        p = by_id[key]
        self.progress.update(p.spec.label, "state", {"state": "stalled"})
        p.kill()  # a stalled process gets no grace period (a stopped one could not use it)
        return self._fail(p, cause)

    def _diagnose(self) -> tuple[list[str], list[str]]:
        """SIGUSR1 to every live process, read back their faulthandler dumps (2 s at most),
        write them to RUN_DIR/stacks/, print the grouped summary; returns the labels of the
        processes found elsewhere than in torch while others wait there, and of those that gave
        no stack while others did."""
        live = [p for p in self.procs if p.poll() is None]
        self._stacks = {id(p): [] for p in live}
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lambda q: q.signal(signal.SIGUSR1), live))
        # a frozen process (silent for half the stall timeout) cannot answer: do not wait for it
        frozen = max(1.0, self.stall_timeout / 2)
        answering = [p for p in live if self.health.silent(id(p)) < frozen]
        deadline, quiet_since = time.monotonic() + 2.0, None
        while time.monotonic() < deadline:
            n = sum(len(v) for v in self._stacks.values())
            self._drain(timeout=0.1)
            if all(stacks.is_dump_complete(self._stacks[id(p)]) for p in answering):
                quiet_since = quiet_since or time.monotonic()
                if sum(len(v) for v in self._stacks.values()) == n and time.monotonic() - quiet_since > 0.3:
                    break
        dumps, no_stack = {}, {}
        for p in live:
            lines = self._stacks[id(p)]
            if stacks.is_dump_complete(lines):
                dumps[p.spec.label] = lines
                try:
                    self.rundir.write_text(
                        os.path.join("stacks", p.spec.log_name.replace(".log", ".txt")), "\n".join(lines) + "\n"
                    )
                except OSError as exc:  # a full disk: the summary below still says where each one stands
                    self.rundir.write_error = self.rundir.write_error or f"cannot write stacks ({exc.strerror})"
            else:
                no_stack[p.spec.label] = (
                    "stopped (SIGSTOP?)"
                    if getattr(p, "stopped", lambda: False)()
                    else f"no answer to SIGUSR1 within 2 s; silent for {self.health.silent(id(p)):.0f} s"
                )
        self._stacks = None
        summary, odd = stacks.summarize(dumps, no_stack)
        self.progress.say(f"hpar: stacks ({os.path.join(self.rundir.path, 'stacks')}):\n" + "\n".join(summary))
        return odd, (list(no_stack) if dumps else [])
