"""Warn once when data-parallel workers train on batches of different sizes.

Synchronous data parallelism averages each worker's mean gradient, so with batches of 8 and 6
samples a sample of the smaller batch weighs 8/6 as much as one of the larger: not the
single-process training on the concatenated batch the user expects (DESIGN.md). The workers
refuse such first batches before training (strategies/job/first_batch.py) unless
``--allow-unequal-batches``; then each worker announces the size of its first batch (``batch``
event, strategies/context.StepMeter) and, once all have, a differing set is printed once,
naming ranks and sizes.
"""

from __future__ import annotations

from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.strategies.job.first_batch import sizes_text


class BatchSizeCheck:
    """Collects the workers' first batch sizes; ``on_event`` is a Supervisor event hook."""

    def __init__(self, world_size: int, strategy: str, say):
        self.world_size, self.say = world_size, say
        self.active = not strategy_spec(strategy).pipelined and world_size > 1  # data-parallel replicas
        self.sizes: dict[int, int] = {}

    def on_event(self, proc, event: dict) -> None:
        if not self.active or proc.spec.role != "worker" or event.get("kind") != "batch":
            return
        self.sizes[proc.spec.rank] = int(event.get("samples", 0))
        if len(self.sizes) == self.world_size:
            self.active = False
            message = self.message(self.sizes)
            if message:
                self.say(message)

    @staticmethod
    def message(sizes: dict[int, int]) -> str | None:
        """The warning for ``sizes`` (rank -> samples), None when they are all equal."""
        if len(set(sizes.values())) <= 1:
            return None
        return (
            f"hpar: warning: workers draw batches of different sizes ({sizes_text(sizes)}); as "
            "--allow-unequal-batches allows, each worker's mean gradient weighs the same (DDP's average), so "
            "this is not training on the concatenated batch"
        )
