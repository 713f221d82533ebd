"""How many distinct shapes a run's forward passes meet, the driver of a worker's growth.

Kernel libraries keep state per input shape: on a CPU, oneDNN's primitive cache (up to 1,024
entries by default) keeps one compiled kernel per shape of each matmul, convolution and LSTM it
runs. A model whose shapes change from batch to batch (examples/lm.py's sampled softmax scores
the batch's distinct target words plus its negatives: a new width most steps) keeps growing
for as long as it meets new shapes, then holds: on examples/lm.py the growth per new forward
signature stayed constant while the growth per step fell (BENCHMARKS.md, "Peak memory,
predicted and measured"). So the memory model counts growth per new shape (the profile's
growth steps give the bytes), times the distinct shapes a run of its length meets (estimated
from a census of the job's batches here).

* :class:`ShapeCensus`: the forward signature (every module's output shapes, in call order) of
  each forward pass while it is entered, and how often each signature was met.
* :func:`draw`: more forward passes, without gradients, on new batches, to fill a census.
* :func:`distinct_after`: the expected number of distinct signatures in ``n`` forward passes,
  from a census's counts: rarefaction up to the census's size, the Chao1-based extrapolation
  beyond it (Chao, Gotelli, Hsieh, Sander, Ma, Colwell and Ellison, "Rarefaction and
  extrapolation with Hill numbers", Ecological Monographs 84(1), 2014: the q = 0 estimators).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

DRAWS = 48  # forward passes in a census (the growth steps' included)
DRAW_BUDGET_S = 1.5  # ... fewer where they take longer than this
STATIC_AFTER = 8  # a census that met one signature in this many passes stops: shapes do not change


class ShapeCensus:
    """Usage: ``with ShapeCensus(model) as c:`` then forward passes, each followed by
    ``c.record()``; ``c.counts()``: how often each distinct signature was met (descending).
    Signatures are tuples of output shapes, so a census costs a few microseconds a module."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.met: dict[tuple, int] = {}
        self._current: list[tuple] = []
        self._handles: list = []

    def __enter__(self) -> "ShapeCensus":
        self._handles = [m.register_forward_hook(self._hook) for m in self.model.modules()]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, module: nn.Module, inputs, output) -> None:
        self._current.append(tuple(tuple(t.shape) for t in tree_leaves(output) if isinstance(t, torch.Tensor)))

    def record(self) -> bool:
        """Close the forward pass since the last record; True when its signature is new."""
        signature, self._current = tuple(self._current), []
        new = signature not in self.met
        self.met[signature] = self.met.get(signature, 0) + 1
        return new

    def counts(self) -> tuple[int, ...]:
        return tuple(sorted(self.met.values(), reverse=True))


def draw(
    census: ShapeCensus,
    forward: Callable[[object], object],
    batches: Iterator,
    most: int = DRAWS,
    budget_s: float = DRAW_BUDGET_S,
) -> None:
    """Forward passes of ``forward(batch)`` under ``torch.no_grad`` on ``batches`` (an entered
    census records each) until the census holds ``most`` passes, ``budget_s`` seconds pass, the
    batches run out, or ``STATIC_AFTER`` passes met a single signature."""
    start = time.perf_counter()
    with torch.no_grad():
        while sum(census.met.values()) < most and time.perf_counter() - start < budget_s:
            if len(census.met) == 1 and sum(census.met.values()) >= STATIC_AFTER:
                return
            try:
                batch = next(batches)
            except StopIteration:
                return
            forward(batch)
            census.record()


def distinct_after(counts: tuple[int, ...], n: int) -> float:
    """Expected distinct signatures in ``n`` forward passes (module docstring), from
    ``counts``: how often each signature met in a census of ``sum(counts)`` passes was met.
    ``n`` up to the census's size: rarefaction, sum over signatures of 1 - C(size - X, n) /
    C(size, n); beyond it: observed + f0 * (1 - (1 - f1 / (size * f0 + f1)) ** (n - size)), with
    f1, f2 the signatures met once and twice and f0 = (size - 1) / size * f1^2 / (2 f2) (f1 (f1 -
    1) / 2 when f2 = 0) the unseen ones. 0 for an empty census or ``n`` < 1."""
    size = sum(counts)
    if not counts or n < 1:
        return 0.0
    if n <= size:
        total = 0.0
        for x in counts:
            unseen = 1.0  # C(size - x, n) / C(size, n): no pass of this signature among n
            for j in range(n):
                unseen *= max(0, size - x - j) / (size - j)
                if unseen == 0.0:
                    break
            total += 1.0 - unseen
        return total
    f1, f2 = sum(1 for x in counts if x == 1), sum(1 for x in counts if x == 2)
    if f1 == 0:
        return float(len(counts))
    f0 = (size - 1) / size * (f1 * f1 / (2 * f2) if f2 else f1 * (f1 - 1) / 2)
    if f0 == 0:
        return float(len(counts))
    return len(counts) + f0 * (1.0 - (1.0 - f1 / (size * f0 + f1)) ** (n - size))


__all__ = ["DRAWS", "ShapeCensus", "draw", "distinct_after"]
