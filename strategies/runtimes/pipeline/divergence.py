"""Divergence guard for asynchronous pipeline schedules (``--on-divergence``).

Staleness can make an asynchronous pipeline diverge where synchronous training would not
(the step size that delayed gradients tolerate shrinks with the delay). The guard watches
the loss of every batch (step) on the last stage; when it is not finite, or exceeds
``factor`` times the lowest loss of the last ``window`` steps, the run either stops
(``stop``) or falls back to synchronous 1F1B for the remaining steps (``sync``).

Where the switch happens: the decision for step s is known to every stage at its end of
step s (one small broadcast from the last stage per step, only with the guard on). Stage
0 is then up to K-1 forwards ahead, so the asynchronous stream is cut after step
``T = s + 1 + ceil((K-1)/M)``: every stage finishes the 1F1B order of the first T*M
micro-batches (a prefix of the order it was running, plus its cool-down backwards), and
steps T.. run as ``1f1b`` (``sync``) or are not run (``stop``). The single-process
simulator applies the same rule, so the two stay equal.
"""

from __future__ import annotations

import math
from collections import deque

from hpar.strategies.job.config import ACTIONS, GuardConfig  # noqa: F401 (the guard's settings live with the run config)


class LossWatch:
    """Feed it each step's loss in step order; :meth:`observe` returns True once it trips."""

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.recent: deque[float] = deque(maxlen=cfg.window)
        self.tripped: dict | None = None

    def observe(self, step: int, loss: float) -> bool:
        """Record ``loss`` of ``step``; True (and ``self.tripped`` set to
        {"step", "loss", "recent_min"}) when it is not finite or above factor * minimum."""
        if self.tripped is not None or self.cfg.action == "off":
            return self.tripped is not None
        low = min(self.recent) if self.recent else math.inf
        if not math.isfinite(loss) or (self.recent and loss > self.cfg.factor * low):
            self.tripped = {"step": step, "loss": loss, "recent_min": low if math.isfinite(low) else None}
            return True
        self.recent.append(loss)
        return False


def cut_step(tripped_step: int, num_stages: int, num_micro: int) -> int:
    """T: the first step that no longer runs asynchronously after a trip at ``tripped_step``
    (every stage is then still before its forward of micro-batch T*M)."""
    return tripped_step + 1 + -(-(num_stages - 1) // num_micro)


def report(cfg: GuardConfig, tripped: dict | None, cut: int | None, steps: int) -> dict:
    """The ``divergence`` entry of summary.json."""
    out = {"action": cfg.action, "factor": cfg.factor, "window": cfg.window, "tripped": tripped is not None}
    if tripped is not None:
        out.update(tripped)
        out["async_steps"] = min(cut, steps)
        out["sync_steps"] = max(steps - cut, 0) if cfg.action == "sync" else 0
    return out
