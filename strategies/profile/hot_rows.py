"""How often each row of an embedding table is looked up, and what a worker's hot-row cache
of the hottest rows would save (``--cache-rows N --staleness s``: strategies/runtimes/hybrid/cache.py,
after HET, Miao et al., VLDB 2022).

:func:`row_counts` runs ``HOT_BATCHES`` batches (drawn round-robin from the workers' streams,
``job.batches(rank, N, batch_size)``) forward without gradients and counts, per row, the
batches that looked it up (a row counts once per batch, however often the batch names it: a
pull moves each distinct row once). :class:`HotRows` keeps the most looked up rows with their
counts (ids by decreasing count, ties by id), which are the first cache epoch's rows.

The prediction (:func:`cache_shares`), per cached row r looked up by a worker's batch with
probability p (its count over the batches), with s the staleness and N workers:

* a worker pushes r with the s + 1-th update it holds of it, p / (s + 1) times a step, and at
  each cache epoch's end (every ``epoch`` steps) when it holds any: with probability
  min(1 - (1 - p)^epoch, s / (s + 1)). Some worker pushes r on a given step with probability
  u = 1 - (1 - p / (s + 1))^N, and each such step is one version of r;
* a pulled copy is read until the servers' version is s ahead, about s / u steps, or to the
  epoch's end: L = min(s / u, epoch) steps, in which the worker looks r up p L times, then
  pulls it once: a share h = p L / (p L + 1) of its lookups of r are hits (s = 0: none);
* the rows pulled per step are the lookups less the hits, the rows pushed per step those not
  cached plus each cached one's flush rate. Both are given as shares of what hybrid moves
  (the sum of p over every row: a batch's distinct rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

HOT_BATCHES = 32  # batches the row counts are taken over
HOT_ROWS_MAX = 1 << 16  # rows kept per table (the first cache epoch can hold no more of the profiled ones)


class _Stop(Exception):
    """Ends a forward once every embedding module has seen its ids."""


@dataclass(frozen=True)
class HotRows:
    """A table's most looked-up rows: ``ids`` by decreasing ``counts`` (the batches, of
    ``batches``, that looked each up), and ``touches``, the sum of every row's count."""

    ids: tuple[int, ...]
    counts: tuple[int, ...]
    batches: int
    touches: int

    @staticmethod
    def from_counts(counts: torch.Tensor, batches: int, keep: int = HOT_ROWS_MAX) -> "HotRows":
        """From per-row counts (int, one per row): the ``keep`` most looked up rows with a count."""
        order = torch.sort(counts.to(torch.int64), descending=True, stable=True).indices  # ties: the lower id first
        top = order[:keep][counts[order[:keep]] > 0]
        return HotRows(tuple(top.tolist()), tuple(counts[top].tolist()), batches, int(counts.sum()))


def row_counts(
    job,
    model: nn.Module,
    embs: list[tuple[str, nn.Module]],
    batch_size: int,
    workers: int,
    batches: int = HOT_BATCHES,
    stop_early: bool = False,
) -> dict[str, HotRows]:
    """``{"<module>.weight": HotRows}`` for every embedding module of ``embs`` (``[(name,
    module)]``) of ``model``, over ``batches`` batches of the ``workers`` streams (see the module
    docstring); ``stop_early`` ends each forward once every module has seen its ids (when each
    is called once per forward). The model runs as the job's forward does, under no_grad."""
    from hpar.strategies.job.forward import call_model

    if not embs:
        return {}
    names = [f"{n}.weight" if n else "weight" for n, _ in embs]
    modules = [m for _, m in embs]
    counts = {n: torch.zeros(m.weight.shape[0], dtype=torch.int32) for n, m in zip(names, modules)}
    seen: dict[str, torch.Tensor] = {}

    def hook(module, args):
        name = names[modules.index(module)]
        hit = seen.setdefault(name, torch.zeros(module.weight.shape[0], dtype=torch.bool))
        hit[args[0].reshape(-1).to("cpu", torch.int64)] = True
        if stop_early and len(seen) == len(names):
            raise _Stop

    streams = [job.batches(r, workers, batch_size) for r in range(min(workers, batches))]
    handles = [m.register_forward_pre_hook(hook) for m in modules]
    drawn = 0
    try:
        with torch.no_grad():
            for i in range(batches):
                batch = next(streams[i % len(streams)], None)
                if batch is None:
                    break
                seen.clear()
                try:
                    call_model(model, batch[0])
                except _Stop:
                    pass
                for n, hit in seen.items():
                    counts[n] += hit.int()
                drawn += 1
    finally:
        for h in handles:
            h.remove()
    return {n: HotRows.from_counts(counts[n], drawn) for n in names}


def cache_shares(
    hot: HotRows, capacity: int, staleness: int, workers: int, epoch: int = 100
) -> tuple[float, float, float]:
    """``(hit rate, pulled share, pushed share)`` of a cache of the ``capacity`` hottest rows
    with staleness ``staleness`` on each of ``workers`` workers, cache epochs of ``epoch``
    steps (see the module docstring): the lookups read from the cache, and the rows pulled and
    pushed per step over hybrid's."""
    if not hot.batches or not hot.touches:
        return 0.0, 1.0, 1.0
    total = hot.touches / hot.batches  # a batch's distinct rows
    p = torch.tensor(hot.counts[:capacity], dtype=torch.float64) / hot.batches
    s = staleness
    at_end = (1 - (1 - p) ** max(1, epoch)).clamp(max=s / (s + 1)) / max(1, epoch)
    flush_rate = p / (s + 1) + at_end
    u = (1 - (1 - p / (s + 1)) ** workers).clamp_min(1e-12)
    reads = p * (s / u).clamp(max=max(1, epoch))  # a copy is pulled again at least once an epoch
    hits = float((p * reads / (reads + 1)).sum()) / total
    pushed = (total - float(p.sum()) + float(flush_rate.sum())) / total
    return hits, 1 - hits, min(1.0, pushed)
