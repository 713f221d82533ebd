"""Rows requested before the lookup that needs them (strategies/runtimes/hybrid/embedding.py serves
the lookups): which batch tensor a served table's rows can be read from ahead
(:func:`covering_leaf`), the lookup's rows put together from an answer requested ahead and a pull
of the rest (:func:`complete`), the requests before a step's forward (:func:`prefetch`) and
during the step before (:class:`PullAhead`).

The modules here are ``embedding.ServedEmbedding`` items and the clock an
``embedding.StepClock``; nothing here changes which rows a lookup gets, only when they are asked
for (the servers answer a pull of step ``t`` only after applying step ``t - 1``).
"""

from __future__ import annotations

import torch

from hpar.strategies.runtimes.hybrid.client import PSClient

from hpar.strategies.profile.sparsity import dedup


def batch_leaves(inputs, path: str = "") -> dict:
    """``{path: tensor}`` of every integer tensor in a (nested) tuple/list/dict batch."""
    if isinstance(inputs, torch.Tensor):
        return {path: inputs} if not inputs.is_floating_point() else {}
    out = {}
    if isinstance(inputs, (tuple, list)):
        for i, x in enumerate(inputs):
            out.update(batch_leaves(x, f"{path}/{i}"))
    elif isinstance(inputs, dict):
        for k, x in inputs.items():
            out.update(batch_leaves(x, f"{path}/{k}"))
    return out


def in_rows(uids: torch.Tensor, rows: int) -> bool:
    """Whether the sorted ids ``uids`` all index rows of a ``rows``-row table (True when empty)."""
    return not uids.numel() or (int(uids[0]) >= 0 and int(uids[-1]) < rows)


def dedup_checked(served, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted unique ids, inverse)`` of ``ids`` on the host (strategies/runtimes/hybrid/client.dedup).
    Raises IndexError naming the table for an id outside its rows (as nn.Embedding would)."""
    uids, inverse = dedup(ids.detach().to("cpu", torch.int64))
    if not in_rows(uids, served.table.rows):
        raise IndexError(f"{served.table.name}: index out of range [0, {served.table.rows}) in the embedding input")
    return uids, inverse


def covering_leaf(uids: torch.Tensor, leaves: dict, rows: int) -> str | None:
    """The path of the batch tensor (``leaves``: :func:`batch_leaves`) with the most distinct
    ids, all of them among ``uids`` (sorted unique ids a module just looked up; ids in
    ``[0, rows)``), or None. Sampled softmax is the case: its candidates are the batch's
    target words plus sampled ones, so the targets' rows can be requested ahead."""
    best, size = None, 0
    for path, t in leaves.items():
        u = torch.unique(t.to("cpu", torch.int64))
        if size < u.numel() <= uids.numel() and in_rows(u, rows):
            pos = torch.searchsorted(uids, u).clamp_(max=uids.numel() - 1)
            if bool((uids[pos] == u).all()):
                best, size = path, u.numel()
    return best


def complete(client: PSClient, item, uids: torch.Tensor, pre: tuple | None, step: int):
    """A function returning rows ``uids`` (sorted unique) of ``item``'s table: the rows among
    those requested ahead (``pre``: ``(tensor, its unique ids, inverse, waiter)``, e.g. the
    targets' rows of a sampled softmax, ``embedding.ServedEmbedding.covers``) taken from that answer,
    only the others pulled now (nothing is sent when every row is there)."""
    if pre is None:
        return client.pull_async(item.table, uids, step)
    have, answer = pre[1], pre[3]
    if have.numel():
        pos = torch.searchsorted(have, uids).clamp_(max=have.numel() - 1)
        hit = have[pos] == uids
    else:
        pos, hit = torch.zeros_like(uids), torch.zeros(uids.numel(), dtype=torch.bool)
    missing = client.pull_async(item.table, uids[~hit], step)

    def wait() -> torch.Tensor:
        part, rest = answer(), missing()
        rows = torch.empty(uids.numel(), item.table.dim, dtype=part.dtype, pin_memory=getattr(client, "pin", False))
        rows[hit] = part[pos[hit]]
        rows[~hit] = rest
        return rows

    return wait


def prefetch(served: list, client: PSClient, clock) -> None:
    """Before the forward of ``clock.step``: request at once the rows of every module whose
    input was, on an earlier step, a tensor of the batch itself (``clock.leaves``), so the
    servers answer them in one wake-up instead of one round trip per module. A module whose
    input included a batch tensor's ids on its first step (``covers``: a sampled softmax's
    candidates hold the batch's targets) gets that tensor's rows now and pulls only the others
    at lookup. A module whose input turns out to be another tensor pulls as usual; the rows
    are the same either way."""
    clock.seen = []
    for item in served:
        if item.ahead is not None:  # requested during the previous step (PullAhead)
            item.prefetched, item.ahead = item.ahead, None
            path = item.source if item.source is not None else item.covers  # "" is a batch that is one tensor
            assert item.prefetched[0] is clock.leaves.get(path), "rows pulled ahead for another batch"
    for item, t, uids, inverse in fed_from_batch([it for it in served if it.prefetched is None], clock.leaves):
        item.prefetched = (t, uids, inverse, client.pull_async(item.table, uids, clock.step))


def fed_from_batch(served: list, leaves: dict, covering: bool = True) -> list[tuple]:
    """``[(module, its ids tensor, unique ids, inverse)]`` for every module of ``served``
    whose input was, on an earlier step, the batch tensor at its ``source`` path in
    ``leaves`` (:func:`batch_leaves` of this batch), and with ``covering`` every module whose
    input included its ids (``covers``; left out when this batch's ids there are not rows of
    the table)."""
    out = []
    for item in served:
        if item.source in leaves:
            out.append((item, leaves[item.source], *dedup_checked(item, leaves[item.source])))
        elif covering and item.covers in leaves:
            uids, inverse = dedup(leaves[item.covers].to("cpu", torch.int64))
            if uids.numel() and in_rows(uids, item.table.rows):
                out.append((item, leaves[item.covers], uids, inverse))
    return out


class PullAhead:
    """The batch iterator of a worker, and the pull of the next step's rows sent while this
    step is still on the wire.

    A step's link is busy twice: the pulls before the forward bring rows in, and the pushes
    and the dense AllReduce in backward take gradients out. The next step's pull needs only
    the next batch's ids and this step's update, which a server applies as soon as every
    worker's push of the table is in (strategies/runtimes/hybrid/ps_server.py defers a pull until then). So once
    this worker pushed its last table, the requests for the next batch's rows (the modules
    :func:`prefetch` serves from batch tensors) go out at once, and their answers come while
    the dense AllReduce, the clipping and the optimizer step finish, instead of after them.
    The rows are the same either way (synchronous semantics are the server's).

    The next batch is read from ``batches`` after this step's forward, on the calling thread,
    so ``data()`` and the model draw random numbers in the same order as without it."""

    def __init__(self, served: list, client: PSClient, batches):
        self.served, self.client, self.batches = served, client, iter(batches)
        self.peeked = None  # the next (inputs, targets), read early
        self.planned = []  # [(ServedEmbedding, host ids tensor, unique ids, inverse)] for step ``step``
        self.step = None
        self.sent = 0  # tables whose rows were requested a step ahead, over the run

    def __iter__(self):
        return self

    def __next__(self):
        if self.peeked is not None:
            batch, self.peeked = self.peeked, None
            return batch
        return next(self.batches)

    def plan(self, step: int) -> None:
        """After step ``step - 1``'s forward: read the next batch and deduplicate the ids of
        every module fed straight from a batch tensor (nothing is sent yet)."""
        if self.peeked is None:
            self.peeked = next(self.batches, None)
        if self.peeked is None:
            return
        # (not the covering modules': their answers would share the links with this step's
        # AllReduce; prefetch asks for them before the forward, when the links are quiet)
        self.planned = fed_from_batch(
            [it for it in self.served if it.ahead is None], batch_leaves(self.peeked[0]), covering=False
        )
        self.step = step

    def send(self, force: bool = False) -> None:
        """Request the planned rows once every module looked up this step has handed its
        gradients over (from the push hook), or now with ``force``."""
        if not self.planned or not (force or all(it.pushed for it in self.served if it.records)):
            return
        for item, t, uids, inverse in self.planned:
            item.ahead = (t, uids, inverse, self.client.pull_async(item.table, uids, self.step))
        self.sent += len(self.planned)
        self.planned = []
