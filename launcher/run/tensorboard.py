"""TensorBoard event files in the run directory, written by the launcher from the metrics it
already receives (``RUN_DIR/tensorboard/``), with torch's ``SummaryWriter``.

Optional: needs the ``tensorboard`` package (``pip install 'hpar[tensorboard]'``); without it
:func:`open_writer` returns None and the run goes on with metrics.jsonl alone.

Scalars (x axis: the optimizer step): ``train/loss`` (worker 0's mean training loss over the
logging interval), ``train/samples_per_s`` (worker 0's), ``train/lr``, ``train/<key>`` for the
script's ``log()`` metrics (from worker 0, or a pipeline's last stage), and ``eval/<key>`` for every ``evaluate()`` result (before
training at step 0, during training with ``--eval-every``, and after the last step).
"""

from __future__ import annotations

import importlib.util
import os


class TensorBoardSink:
    """Turns worker 0's metric, eval and summary records into TensorBoard scalars."""

    def __init__(self, writer):
        self.writer = writer

    def record(self, record: dict) -> None:
        """One record as RunDir.metric gets it (``kind``, ``role``, ``rank``, payload keys).
        The script's ``log()`` metrics come from the one worker that calls it: worker 0, or a
        pipeline's last stage (which holds the output and targets)."""
        step = record.get("step")
        if record.get("role") != "worker" or step is None:
            return
        if record.get("kind") == "metric" and record.get("logged"):
            for key, value in record["logged"].items():
                self.writer.add_scalar(f"train/{key}", value, step)
        if record.get("rank") != 0:
            if record.get("logged"):
                self.writer.flush()
            return
        if record.get("kind") == "metric":
            for key in ("loss", "samples_per_s", "lr"):
                if isinstance(record.get(key), (int, float)):
                    self.writer.add_scalar(f"train/{key}", record[key], step)
        elif record.get("kind") == "eval":
            self.add_eval(record, step)
        self.writer.flush()

    def add_eval(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            if key not in ("kind", "role", "rank", "host", "time", "step") and isinstance(value, (int, float)):
                self.writer.add_scalar(f"eval/{key}", value, step)

    def summary(self, summary: dict) -> None:
        """The evaluations before and after training (step 0 and the last step)."""
        if summary.get("eval_first"):
            self.add_eval(summary["eval_first"], 0)
        if summary.get("eval_last"):
            self.add_eval(summary["eval_last"], int(summary.get("steps") or 0))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_writer(run_dir: str) -> TensorBoardSink | None:
    """A sink writing under ``run_dir/tensorboard``, or None when tensorboard is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return TensorBoardSink(SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard")))
