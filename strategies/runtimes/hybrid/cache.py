"""A worker's cache of a served table's hot rows, with bounded staleness (``--cache-rows N
--staleness s`` under ``hybrid`` and ``ps``): the worker's half of the protocol; the server's
half is strategies/runtimes/hybrid/versions.py, the requests strategies/runtimes/hybrid/cache_client.py.

Source: Miao et al., "HET: Scaling out Huge Embedding Model Training via Cache-enabled
Distributed Framework", VLDB 2022: a cache of the hot rows on each worker with a clock per row,
a cached row read while its clock is at most s behind the server's, a cached row's gradients
held back and pushed when the bound requires.

The rules here, for a table with a cache of the rows ``ids`` (at most N, the hottest):
**reads** from the cache only where the server said, in an answer of the step before, that the
row may be (``ok[slot] == step``: its version there at most s ahead of the copy's), so a read
misses at most s of the server's updates; **writes** add up a cached row's gradients and count
them, pushing everything held of the row with the gradient that would make the count s + 1
(HET's bound), a pushed row counting as one worker's gradient of the step that pushes it;
**epochs** end before a checkpoint, the last step and every ``REFRESH_STEPS`` steps (a plan's
``cache.refresh_steps``), pushing everything held and choosing the rows again (the N most looked
up, ties: the rows cached before, then the lower id). The first epoch's rows are the plan's
``cache["hot_rows"]`` (strategies/profile/hot_rows.py).

Invariants: with s = 0 every gradient passes through unchanged, so the training is ``hybrid``'s
bit for bit; a checkpoint holds no gradient a worker held back and carries the next epoch's rows,
so a resumed run is bit-identical to one that went on. The user's view: docs/cache.md.
"""

from __future__ import annotations


import torch


class RowCache:
    """One served table's cache on one worker (see the module docstring): the cached rows
    ``ids`` (ascending global ids, at most ``capacity``), their values as last pulled, the step
    each may be read on (``ok``), the gradients held back (``held``) and how many updates each
    holds (``count``, at most ``staleness``)."""

    def __init__(self, table, ids: torch.Tensor, capacity: int, staleness: int):
        assert staleness >= 0
        self.table, self.capacity, self.staleness = table, capacity, staleness
        self.epoch = 0
        self.window: list[torch.Tensor] = []  # ids looked up this epoch (the refresh's counts)
        self.hits = self.lookups = 0
        self._set(ids)

    def _set(self, ids: torch.Tensor) -> None:
        ids = torch.unique(ids.to(torch.int64))[: self.capacity]
        dim, dtype = self.table.dim, self.table.dtype
        self.ids = ids
        self.values = torch.zeros(ids.numel(), dim, dtype=dtype)
        self.held = torch.zeros(ids.numel(), dim, dtype=dtype)
        self.count = torch.zeros(ids.numel(), dtype=torch.int64)
        self.ok = torch.full((ids.numel(),), -1, dtype=torch.int64)
        self._last = None  # (ids, member, slot) of the last lookup: its gradients come with the same tensor
        owner = self.table.layout.server_of(ids) if ids.numel() else ids
        self.on_server = {s: (owner == s).nonzero().squeeze(1) for s in range(self.table.layout.num_servers)}

    def slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(member, slot)`` for sorted unique ``ids``: whether each is cached, and where."""
        if self._last is not None and self._last[0] is ids:
            return self._last[1], self._last[2]
        if not self.ids.numel() or not ids.numel():
            return torch.zeros(ids.numel(), dtype=torch.bool), torch.zeros(ids.numel(), dtype=torch.int64)
        slot = torch.searchsorted(self.ids, ids).clamp_(max=self.ids.numel() - 1)
        return self.ids[slot] == ids, slot

    def split(self, ids: torch.Tensor, step: int, count: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """For the rows ``ids`` (sorted unique) a training step ``step`` looks up: ``(hit, slot)``,
        which of them are read from the cache and their slots. ``count``: add them to the hit
        rate and the refresh's window."""
        member, slot = self.slots(ids)
        self._last = (ids, member, slot)
        hit = member & (self.ok[slot] == step) if ids.numel() else member
        if count:
            self.lookups += ids.numel()
            self.hits += int(hit.sum())
            self.window.append(ids)
        return hit, slot

    def fill(self, ids: torch.Tensor, rows: torch.Tensor, known: tuple | None = None) -> None:
        """Store the pulled ``rows`` of ``ids`` (sorted unique) that are cached; ``known``:
        their ``(member, slot)`` where the caller has them (:meth:`slots`)."""
        member, slot = self.slots(ids) if known is None else known
        if bool(member.any()):
            self.values[slot[member]] = rows[member].to(self.values.dtype)

    def readable(self, server: int, packed: torch.Tensor, step: int) -> None:
        """The bits of an answer from ``server`` to a pull of ``step`` (versions.pack_bits over
        the cached rows it holds, in order): those set may be read on ``step + 1``."""
        from hpar.strategies.runtimes.hybrid.versions import unpack_bits

        slots = self.on_server[server]
        fresh = unpack_bits(packed, slots.numel())
        self.ok[slots[fresh]] = step + 1

    def outgoing(self, grads: tuple[torch.Tensor, torch.Tensor] | None, flush: bool):
        """What to push of this table now, given this micro-step's gradients ``grads``
        (``(unique ids, rows)`` or None): the rows that are not cached, and every cached row
        whose held updates with this one's would exceed s (its held sum plus this gradient;
        a row with nothing held passes through untouched, in the order given: at s = 0 every
        row); with ``flush`` (an epoch's end) every held row. None when there is nothing to
        push and no gradient was given."""
        out_ids, out_rows = [], []
        if grads is not None:
            ids, rows = grads
            member, slot = self.slots(ids)
            keep = member.clone()
            if bool(member.any()):
                held = self.count[slot[member]]
                keep[member] = (held > 0) | ((held + 1 <= self.staleness) & (not flush))
            if bool(keep.any()):
                self.held[slot[keep]] += rows[keep].to(self.held.dtype)
                self.count[slot[keep]] += 1
            out_ids.append(ids[~keep])
            out_rows.append(rows[~keep])
        if flush:
            where = self.count.nonzero().squeeze(1)
        else:  # only a row given a gradient now can have gone past s
            changed = slot[keep] if grads is not None else torch.empty(0, dtype=torch.int64)
            where = changed[self.count[changed] > self.staleness].sort().values
        if where.numel():
            out_ids.append(self.ids[where])
            out_rows.append(self.held[where].to(self.table.dtype))
            self.held[where] = 0
            self.count[where] = 0
        if not out_ids:
            return None
        if len(out_ids) == 1:
            return out_ids[0], out_rows[0]
        return torch.cat(out_ids), torch.cat(out_rows)

    def next_rows(self, refresh: bool) -> torch.Tensor:
        """The rows of the next epoch: with ``refresh`` the ``capacity`` most looked up this
        epoch (ties: cached now, then the lower id), filled up with the rows cached now; else
        the rows cached now."""
        if not refresh or not self.window:
            return self.ids
        seen, counts = torch.unique(torch.cat(self.window), return_counts=True)
        cand = torch.unique(torch.cat([seen, self.ids]))  # ascending
        score = torch.zeros(cand.numel(), dtype=torch.int64)
        score[torch.searchsorted(cand, seen)] = counts * 2
        score[torch.searchsorted(cand, self.ids)] += 1
        order = torch.sort(score, descending=True, stable=True).indices  # ties keep the ascending ids
        return cand[order[: self.capacity]].sort().values

    def new_epoch(self, ids: torch.Tensor) -> None:
        """Start an epoch with the rows ``ids``: nothing readable until pulled again; what was
        held back must have been pushed (asserted)."""
        assert not bool(self.count.any()), "a cache epoch ends with every held gradient pushed"
        if torch.equal(ids, self.ids):
            self.ok.fill_(-1)
        else:
            self._set(ids)
        self.epoch += 1
        self.window = []

    def state(self) -> torch.Tensor:
        """The cached rows, padded with -1 to ``capacity`` (what a checkpoint keeps)."""
        out = torch.full((self.capacity,), -1, dtype=torch.int64)
        out[: self.ids.numel()] = self.ids
        return out
