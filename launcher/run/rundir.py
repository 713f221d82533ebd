"""The run directory: resolved config, one log per process, metrics.jsonl, summary.json.

Layout::

    RUN_DIR/.hpar-run          hpar's marker: hpar made this directory (strategies/state/trust.py)
    RUN_DIR/config.json        the resolved RunConfig (what every process reads)
    RUN_DIR/plan.json          the planner's plan, when there is one
    RUN_DIR/logs/worker-0.log  everything worker 0 printed (likewise server-<i>.log)
    RUN_DIR/metrics.jsonl      one JSON line per process per logging interval or heartbeat
    RUN_DIR/summary.json       written once at the end (also after a failure)
    RUN_DIR/checkpoints/       see strategies/state/checkpoint.py
    RUN_DIR/model/             the trained model, written where it lives (strategies/state/state.py)
    RUN_DIR/hf/                a transformers model's save_pretrained directory (from_pretrained loads it)
    RUN_DIR/tensorboard/       TensorBoard event files, when tensorboard is installed
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from collections import deque

from hpar.launcher.run.tensorboard import open_writer
from hpar.strategies.state.checkpoint import atomic_write_bytes
from hpar.strategies.state.trust import claim
from hpar.strategies.job.config import RunConfig


def default_run_dir() -> str:
    """``runs/<UTC timestamp>`` under the current directory."""
    return os.path.join("runs", datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S-%f"))


class RunDir:
    """Files of one run. Log files are opened lazily and closed by :meth:`close`. The
    directory is this user's marked run directory (strategies/state/trust.py ``claim``:
    made 0700, or 0750 when ``group_readable``; ``adopt`` takes an unmarked run being
    resumed); raises ValueError as ``claim`` does."""

    def __init__(self, path: str, group_readable: bool = False, adopt: bool = False):
        self.path = os.path.abspath(path)
        claim(self.path, group_readable, adopt)
        os.makedirs(os.path.join(self.path, "logs"), exist_ok=True)
        self.config_sha256: str | None = None  # of the config.json written last (workers check it)
        self._logs: dict[str, object] = {}
        self._tails: dict[str, deque] = {}
        self._metrics = open(os.path.join(self.path, "metrics.jsonl"), "a", encoding="utf-8")
        self.write_error: str | None = None  # the first failed write of a log or metrics line
        self._tensorboard = open_writer(self.path)

    @property
    def config_path(self) -> str:
        return os.path.join(self.path, "config.json")

    def write_config(self, cfg: RunConfig) -> None:
        """Write config.json (and plan.json); :attr:`config_sha256` is its SHA-256, which the
        processes get in ``HPAR_CONFIG_SHA256`` and check before they use it."""
        data = cfg.to_json().encode()
        atomic_write_bytes(self.config_path, data)
        self.config_sha256 = hashlib.sha256(data).hexdigest()
        if not cfg.plan.empty:
            atomic_write_bytes(os.path.join(self.path, "plan.json"), json.dumps(cfg.plan.to_dict(), indent=2).encode())

    def log_line(self, log_name: str, line: str) -> None:
        """Append ``line`` to that process's log and keep it in its tail."""
        if log_name not in self._tails:
            self._tails[log_name] = deque(maxlen=20)
        self._tails[log_name].append(line)
        try:
            f = self._logs.get(log_name)
            if f is None:
                f = self._logs[log_name] = open(os.path.join(self.path, "logs", log_name), "a", encoding="utf-8")
            f.write(line + "\n")
            f.flush()
        except OSError as exc:
            self._write_failed(exc)

    def _write_failed(self, exc: OSError) -> None:
        """A log or metrics write failed (a full disk): supervision goes on; said once."""
        if self.write_error is None:
            self.write_error = f"{self.path}: cannot write logs and metrics ({exc.strerror}); they are incomplete"

    def tail(self, log_name: str, n: int = 10) -> list[str]:
        return list(self._tails.get(log_name, ()))[-n:]

    def metric(self, record: dict) -> None:
        try:
            self._metrics.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._metrics.flush()
        except OSError as exc:
            self._write_failed(exc)
        if self._tensorboard is not None:
            self._tensorboard.record(record)

    def write_text(self, relative: str, text: str) -> None:
        """Write ``text`` to RUN_DIR/``relative`` (atomically)."""
        atomic_write_bytes(os.path.join(self.path, relative), text.encode())

    def read_summary(self) -> dict | None:
        """summary.json of an earlier attempt in this directory (None when absent or torn)."""
        try:
            with open(os.path.join(self.path, "summary.json"), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def write_summary(self, summary: dict) -> None:
        if self._tensorboard is not None:
            self._tensorboard.summary(summary)
        atomic_write_bytes(
            os.path.join(self.path, "summary.json"), json.dumps(summary, indent=2, sort_keys=True).encode()
        )

    def close(self) -> None:
        for f in [*self._logs.values(), self._metrics]:
            try:
                f.close()
            except OSError as exc:  # the last buffered bytes did not fit
                self._write_failed(exc)
        if self._tensorboard is not None:
            self._tensorboard.close()
