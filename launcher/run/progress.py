"""Live progress: a rich table per process on a terminal, plain lines otherwise.

The table has one row per worker/server: host, step, loss, samples/s, bytes sent and
received per step, CPU and memory (psutil, from heartbeats), GPU memory where present, and the
state (running, stalled, exited), and the script's ``log()`` figures once it reports any. Plain
mode prints one line per metric report instead, the ``log()`` figures after a ``|``.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

# a launcher's exit codes after a SIGINT (Ctrl-C) or a SIGTERM (128 + the signal, as a shell reports them)
STOPPED_BY = {130: "interrupted (Ctrl-C)", 143: "terminated (SIGTERM)"}


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} TB"


def _num(value, spec: str) -> str:
    """``value`` formatted with ``spec``, or "-" when it is not a number (a middle pipeline
    stage reports no loss: only the last stage computes it)."""
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


LOGGED_WIDTH = 60  # characters of the script's log() figures shown with a progress report


def logged_text(logged: dict | None, width: int = LOGGED_WIDTH) -> str:
    """The script's ``log()`` figures of a progress report (the interval's means), as
    ``name value`` pairs (4 significant digits) in the order given, cut to ``width``
    characters with "..." (metrics.jsonl and TensorBoard keep them whole)."""
    if not logged:
        return ""
    text = " ".join(f"{k} {_num(v, '.4g')}" for k, v in logged.items())
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


class Progress:
    """Shows the state of every process. ``live`` defaults to "stdout is a terminal"."""

    def __init__(
        self, labels: list[tuple[str, str]], total_steps: int, live: bool | None = None, console: Console | None = None
    ):
        self.console = console or Console()
        self.live_mode = sys.stdout.isatty() if live is None else live
        self.total_steps = total_steps
        self.rows = {label: {"host": host, "state": "starting"} for label, host in labels}
        self._live: Live | None = None
        self._last_refresh = 0.0

    def __enter__(self):
        if self.live_mode:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(*exc)
            self._live = None

    def say(self, text: str) -> None:
        """Print a line above the live view (or plainly)."""
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def update(self, label: str, kind: str, payload: dict) -> None:
        row = self.rows.setdefault(label, {"host": "?", "state": "running"})
        if kind == "metric":
            row.update(
                state="running",
                **{k: payload.get(k) for k in ("step", "loss", "samples_per_s", "bytes_sent", "bytes_recv")},
            )
            if payload.get("logged"):
                row["logged"] = payload["logged"]
            if not self.live_mode:
                logged = logged_text(payload.get("logged"))
                self.say(
                    f"[{row['host']} {label}] step {payload.get('step')}/{self.total_steps} "
                    f"loss {_num(payload.get('loss'), '.4f')} "
                    f"{_num(payload.get('samples_per_s'), '.1f')} samples/s "
                    f"sent {human_bytes(payload.get('bytes_sent'))}/step" + (f" | {logged}" if logged else "")
                )
        elif kind == "heartbeat":
            row.update({k: payload.get(k) for k in ("cpu_percent", "rss_bytes", "gpu_bytes")})
            if row.get("state") == "starting":
                row["state"] = "running"
        elif kind == "state":
            row["state"] = payload["state"]
        self.refresh()

    def mark_stopped(self) -> None:
        """Every process still shown starting or running is marked ``stopped`` (the run ended:
        Ctrl-C, a failure elsewhere), and the live table is redrawn at once."""
        for row in self.rows.values():
            if row.get("state") in ("starting", "running"):
                row["state"] = "stopped"
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._live is not None and (force or now - self._last_refresh > 0.25):
            self._last_refresh = now
            self._live.update(self._table())

    def _table(self) -> Table:
        t = Table(title=f"hpar: {self.total_steps} steps", expand=False)
        logged = any(r.get("logged") for r in self.rows.values())  # a column only once the script logs
        cols = (
            "process",
            "host",
            "step",
            "loss",
            "samples/s",
            "sent/step",
            "recv/step",
            "cpu %",
            "memory",
            "gpu mem",
            "state",
        ) + (("log()",) if logged else ())
        for col in cols:
            t.add_column(
                col,
                justify="right" if col not in ("process", "host", "state", "log()") else "left",
                **({"max_width": LOGGED_WIDTH} if col == "log()" else {}),
            )
        for label, r in self.rows.items():
            loss = r.get("loss")
            t.add_row(
                label,
                str(r.get("host", "")),
                f"{r.get('step', '-')}",
                f"{loss:.4f}" if isinstance(loss, (int, float)) else "-",
                f"{r['samples_per_s']:.1f}" if isinstance(r.get("samples_per_s"), (int, float)) else "-",
                human_bytes(r.get("bytes_sent")),
                human_bytes(r.get("bytes_recv")),
                f"{r['cpu_percent']:.0f}" if isinstance(r.get("cpu_percent"), (int, float)) else "-",
                human_bytes(r.get("rss_bytes")),
                human_bytes(r.get("gpu_bytes")),
                r.get("state", ""),
                *((logged_text(r.get("logged")),) if logged else ()),
            )
        return t


def final_line(s: dict, run_dir: str, lead: str = "done") -> str:
    """The line ``hpar run`` ends with: global samples/s of the measured window, worker 0's
    training loss averaged over the first and the last logging interval (as the progress
    lines average it), and ``evaluate()``'s figures before and after, each prefixed
    ``eval`` so that an evaluate key named ``loss`` cannot be mistaken for the training loss.
    ``lead`` comes first (a resume with nothing to do says so, with the run's own figures)."""
    first, last = s.get("loss_first_mean", s.get("loss_first")), s.get("loss_last_mean", s.get("loss_last"))
    steps = s.get("loss_mean_steps")
    avg = ""
    if steps:
        avg = (
            f" (step 1, and the mean of the last {steps[1]} steps)"
            if steps[0] == 1 and steps[1] > 1
            else f" (mean of the first {steps[0]} and last {steps[1]} steps)"
        )
    ev = ", ".join(
        f"eval {k} {_num((s.get('eval_first') or {}).get(k), '.4g')} -> {_num(v, '.4g')}"
        for k, v in (s.get("eval_last") or {}).items()
    )
    return (
        f"hpar: {lead}: {_num(s.get('samples_per_s'), '.1f')} samples/s, training loss {_num(first, '.4f')} -> "
        f"{_num(last, '.4f')}{avg}{'; ' + ev if ev else ''}; run dir {run_dir}"
    )


def stopped_line(s: dict, run_dir: str, exit_code: int) -> str:
    """The line ``hpar run`` ends with when the run did not finish (``exit_code`` not 0): how
    it ended, the furthest step a worker reported (summary ``steps``), the run directory, and
    the last complete checkpoint with the command that resumes from it (or that there is
    none). ``s`` empty: the run's summary.json is read."""
    import json
    import os
    from hpar.strategies.state.checkpoint import latest_step

    if not s:
        try:
            with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
                s = json.load(f)
        except (OSError, ValueError):
            s = {}
    try:
        saved = latest_step(run_dir)
    except ValueError:  # a damaged `latest`: --resume falls back past it, and says so
        saved = "damaged"
    how = STOPPED_BY.get(exit_code, f"failed (exit code {exit_code})")
    step = s.get("steps")
    at = f" at step {step}" if isinstance(step, int) and step > 0 else ""
    if saved is None:
        then = "no checkpoint to resume from (--checkpoint-every N writes them)"
    else:
        then = (
            f"last complete checkpoint: step {saved}; " if isinstance(saved, int) else ""
        ) + f"resume with: hpar run --resume {run_dir}"
    return f"hpar: {how}{at}; run dir {run_dir}; {then}"


def last_reported(progress: "Progress") -> dict:
    """``steps``: the furthest step any worker reported (0 before the first report) and
    ``loss_last``: the loss reported with it (None without one): what summary.json says of a
    run that failed or was stopped."""
    rows = [r for label, r in progress.rows.items() if label.startswith("worker") and isinstance(r.get("step"), int)]
    if not rows:
        return {"steps": 0, "loss_last": None}
    top = max(r["step"] for r in rows)
    losses = [r.get("loss") for r in rows if r["step"] == top and isinstance(r.get("loss"), (int, float))]
    return {"steps": top, "loss_last": losses[0] if losses else None}
