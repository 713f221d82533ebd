"""The planner as ``hpar run`` uses it: profile the job, describe the cluster, choose a plan."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field


def runnable_strategies() -> set[str]:
    """Strategies whose runtime is installed (the planner only chooses among these)."""
    have = {"allreduce", "allreduce-sparse"}
    if importlib.util.find_spec("hpar.strategies.hybrid"):
        have |= {"hybrid", "ps"}
    if importlib.util.find_spec("hpar.strategies.pipeline"):
        have.add("pipeline")
    return have


@dataclass(frozen=True)
class _FallbackPlan:
    strategy: str = "allreduce"
    reason: str = "the planner is not installed; allreduce is the default"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "reason": self.reason}


def plan_job(job, batch_size: int, hosts: tuple, gpus: int, servers: int | None):
    """Profile ``job`` and return the planner's Plan for ``gpus`` workers on ``hosts``."""
    if importlib.util.find_spec("hpar.strategies.planner") is None:
        return _FallbackPlan()
    raise NotImplementedError
