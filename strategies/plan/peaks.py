"""The run's measured peak memory per process, beside the plan's prediction.

Every worker and parameter server reports its peak above its baseline at the end of training
(a ``memory`` event: strategies/common/measured_memory.py, workers/worker.py and workers/server.py). This
module writes each report to ``metrics.jsonl`` (``"kind": "memory"``, with the process's role
and rank) and puts the largest over the workers and over the servers into ``summary.json``
as ``peak_bytes`` (``{"worker": ..., "server": ...}``, null for a role with no report or none
running), beside ``predicted_peak_bytes`` in the same shape, which the plan's memory model
predicted (strategies/plan/memory_model.py; the plan's ``memory``).
"""

from __future__ import annotations

import time

from hpar.strategies.specs.decision import Plan

FIGURES = (
    "peak_bytes",
    "rss_peak_bytes",
    "allocated_peak_bytes",
    "reserved_peak_bytes",
    "baseline_bytes",
    "final_peak_bytes",  # after the last step: the final write (and worker 0's copy for evaluate())
    "trims",
)  # trims: how often the process handed freed heap blocks back (strategies/common/measured_memory.py)


class PeakFigures:
    """Supervisor hook (``on_event``) collecting the processes' ``memory`` events into
    ``rundir``'s metrics, and :meth:`apply` to a summary."""

    def __init__(self, rundir):
        self.rundir = rundir
        self.peaks: dict[str, dict[int, dict]] = {"worker": {}, "server": {}}

    def on_event(self, proc, event: dict) -> None:
        if event.get("kind") != "memory":
            return
        role = proc.spec.role
        figures = {k: event.get(k) for k in FIGURES}
        self.peaks.setdefault(role, {})[proc.spec.rank] = figures
        self.rundir.metric(
            {
                "kind": "memory",
                "role": role,
                "rank": proc.spec.rank,
                "host": proc.spec.host,
                "time": time.time(),
                **figures,
            }
        )

    def largest(self, role: str, key: str = "peak_bytes") -> int | None:
        """The largest ``key`` over the processes of ``role`` (None: none reported one)."""
        values = [f[key] for f in self.peaks.get(role, {}).values() if isinstance(f.get(key), int)]
        return max(values) if values else None

    def apply(self, summary: dict, plan: Plan | None) -> dict:
        """``summary`` with ``peak_bytes`` (measured, the largest per role), the per-role
        allocator figures where a GPU gave them, and ``predicted_peak_bytes`` (the plan's)."""
        out = dict(summary)
        out["peak_bytes"] = {role: self.largest(role) for role in ("worker", "server")}
        extra = {
            f"{role}_{key}": self.largest(role, key)
            for role in ("worker", "server")
            for key in ("rss_peak_bytes", "reserved_peak_bytes", "baseline_bytes", "final_peak_bytes")
        }
        out["peak_memory"] = {k: v for k, v in extra.items() if v is not None}
        predicted = (plan.memory if plan is not None else None) or {}
        out["predicted_peak_bytes"] = {
            "worker": predicted.get("worker_peak_bytes"),
            "server": predicted.get("server_peak_bytes"),
        }
        return out
