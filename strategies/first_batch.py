"""A worker's first batch: drawn within the launcher's phase deadline.

Every runtime draws its batches from the user's ``data()`` (``job.batches``); the first draw
is where a data loader that never delivers (a dead file system, a tokenizer server that does
not answer, a queue nobody fills) shows, before any step could be counted. The batches a
resumed run skips (those the run trained on before its checkpoint, so that it sees the same
data as an uninterrupted run) and then the first batch it trains on are drawn under
``activity.doing`` (strategies/activity.py): a worker that gets no batch within
``--phase-timeout`` is named with what it was doing and its stack, instead of leaving its
peers waiting in their first collective under the start-up bound.
"""
from __future__ import annotations

from typing import Any, Callable

from hpar.strategies import activity

SKIPPING = "in data(), skipping the batches the run trained on before its checkpoint"
DRAWING = "in data(), drawing its first batch"


def first_batch(draw: Callable[[int], Any], skip: int = 0) -> Any:
    """Draw batches ``0 .. skip-1`` of the run with ``draw(i)`` and drop them (each within the
    deadline, not their sum), then return batch ``skip``, the first to train on."""
    if skip:
        with activity.doing(SKIPPING):
            for i in range(skip):
                draw(i)
                activity.tick()
    with activity.doing(DRAWING):
        return draw(skip)
