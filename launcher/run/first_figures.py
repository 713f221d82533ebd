"""The run's true first figures, kept across restarts and ``--resume``.

A resumed or restarted attempt only sees the steps it runs, so its own ``loss_first`` is the
loss at the resume step and it has no ``eval_first`` (evaluate() runs before step 1 only). The
workers announce the figures as they happen (``first_loss`` from every worker after the run's
step 1, ``first_eval`` from rank 0 before it); this module keeps them in
``RUN_DIR/first.json`` and puts them into the summary of whichever attempt finishes.
"""

from __future__ import annotations

import json
import math
import os

from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.strategies.state.checkpoint import atomic_write_bytes

FILE = "first.json"


class FirstFigures:
    """``loss_first`` (mean over the workers' step-1 losses; a pipeline's from rank 0, the
    stage that receives the loss) and ``eval_first`` of the run in ``run_dir``."""

    def __init__(self, run_dir: str, world_size: int, strategy: str):
        self.path = os.path.join(run_dir, FILE)
        self.world_size, self.strategy = world_size, strategy
        self.losses: dict[int, float] = {}
        try:
            with open(self.path, encoding="utf-8") as f:
                self.saved = json.load(f)
        except (OSError, ValueError):
            self.saved = {}

    def on_event(self, proc, event: dict) -> None:
        """Supervisor hook: take ``first_loss`` and ``first_eval`` events of worker processes."""
        if proc.spec.role != "worker":
            return
        if event.get("kind") == "first_eval" and isinstance(event.get("eval"), dict):
            self._save(eval_first=event["eval"])
        elif event.get("kind") == "first_loss" and isinstance(event.get("loss"), (int, float)):
            self.losses[proc.spec.rank] = float(event["loss"])
            if strategy_spec(self.strategy).pipelined and 0 in self.losses:  # the last stage's loss
                self._save(loss_first=self.losses[0])
            elif not strategy_spec(self.strategy).pipelined and len(self.losses) == self.world_size:
                self._save(loss_first=sum(self.losses.values()) / self.world_size)

    def _save(self, **figures) -> None:
        self.saved = {**self.saved, **figures}
        atomic_write_bytes(self.path, json.dumps(self.saved, indent=2).encode())

    def apply(self, summary: dict, previous: dict | None = None, resumed: bool = False) -> dict:
        """``summary`` with the run's first figures; figures an attempt that ran no step could
        not know (``loss_last`` after resuming at the last step) come from ``previous``. A
        ``resumed`` attempt's own first interval is not the run's: the training loss then runs
        from the run's step 1 (``loss_mean_steps`` [1, k]) to the mean of its last interval, as
        ``eval`` runs from before the run's step 1, so that every figure of the final line
        spans the same run (launcher/run/progress.final_line)."""
        out = dict(summary)
        for key in ("loss_first", "eval_first"):
            if key in self.saved:
                out[key] = self.saved[key]
        if resumed and "loss_first" in self.saved and out.get("loss_mean_steps"):
            out["loss_first_mean"] = self.saved["loss_first"]
            out["loss_mean_steps"] = [1, out["loss_mean_steps"][1]]
        previous = previous or {}
        for key in ("loss_first", "loss_last"):
            value = out.get(key)
            if (value is None or (isinstance(value, float) and math.isnan(value))) and previous.get(key) is not None:
                out[key] = previous[key]
        return out
