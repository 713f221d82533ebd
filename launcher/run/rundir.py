"""The run directory: resolved config, one log per process, metrics.jsonl, summary.json.

Layout::

    RUN_DIR/config.json        the resolved RunConfig (what every process reads)
    RUN_DIR/plan.json          the planner's plan, when there is one
    RUN_DIR/logs/worker-0.log  everything worker 0 printed (likewise server-<i>.log)
    RUN_DIR/metrics.jsonl      one JSON line per process per logging interval or heartbeat
    RUN_DIR/summary.json       written once at the end (also after a failure)
    RUN_DIR/checkpoints/       see strategies/checkpoint.py
    RUN_DIR/model.pt           the trained model's state_dict (worker 0, at the end)
    RUN_DIR/tensorboard/       TensorBoard event files, when tensorboard is installed
"""
from __future__ import annotations

import datetime
import json
import os
from collections import deque

from hpar.launcher.run.tensorboard import open_writer
from hpar.strategies.checkpoint import atomic_write_bytes
from hpar.strategies.config import RunConfig


def default_run_dir() -> str:
    """``runs/<UTC timestamp>`` under the current directory."""
    return os.path.join("runs", datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S-%f"))


class RunDir:
    """Files of one run. Log files are opened lazily and closed by :meth:`close`."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        os.makedirs(os.path.join(self.path, "logs"), exist_ok=True)
        self._logs: dict[str, object] = {}
        self._tails: dict[str, deque] = {}
        self._metrics = open(os.path.join(self.path, "metrics.jsonl"), "a", encoding="utf-8")
        self._tensorboard = open_writer(self.path)

    @property
    def config_path(self) -> str:
        return os.path.join(self.path, "config.json")

    def write_config(self, cfg: RunConfig) -> None:
        atomic_write_bytes(self.config_path, cfg.to_json().encode())
        if cfg.plan:
            atomic_write_bytes(os.path.join(self.path, "plan.json"), json.dumps(cfg.plan, indent=2).encode())

    def log_line(self, log_name: str, line: str) -> None:
        """Append ``line`` to that process's log and keep it in its tail."""
        f = self._logs.get(log_name)
        if f is None:
            f = self._logs[log_name] = open(os.path.join(self.path, "logs", log_name), "a", encoding="utf-8")
            self._tails[log_name] = deque(maxlen=20)
        f.write(line + "\n")
        f.flush()
        self._tails[log_name].append(line)

    def tail(self, log_name: str, n: int = 10) -> list[str]:
        return list(self._tails.get(log_name, ()))[-n:]

    def metric(self, record: dict) -> None:
        self._metrics.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._metrics.flush()
        if self._tensorboard is not None:
            self._tensorboard.record(record)

    def write_summary(self, summary: dict) -> None:
        if self._tensorboard is not None:
            self._tensorboard.summary(summary)
        atomic_write_bytes(os.path.join(self.path, "summary.json"), json.dumps(summary, indent=2, sort_keys=True).encode())

    def close(self) -> None:
        for f in self._logs.values():
            f.close()
        self._metrics.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
