"""The server half of the hot-row cache: what each worker's cache holds of this server's rows,
and which of those rows moved past the staleness bound (strategies/runtimes/hybrid/cache.py is the
worker's half; the protocol is described there).

HET (Miao et al., "HET: Scaling out Huge Embedding Model Training via Cache-enabled
Distributed Framework", VLDB 2022) keeps a clock per embedding row on the servers and on each
worker's cached copy, and lets a worker read its copy while the two clocks are at most s
apart. Here a row's clock is its **version**: the number of updates the server applied to it
(``shard.ParamShard.versions``, one int64 per row, counted where the update is applied). For
every worker and table this server keeps the rows that worker caches on it (sorted local ids,
as the worker announced them in a ``CACHE`` request at the start of each cache epoch) and the
version each was at when this server last sent it to that worker (-1: not sent this epoch).

Every answer to a cached pull (``PULL_CACHED``) carries, behind the requested rows, one bit
per row the worker caches on this server, in the announced order: set when the row may be
read from the cache on the worker's *next* step. Since a row gains at most one version per
step (an update is applied once per step), a row sent at version c and now at version V is
readable on the next step only if V + 1 - c <= s, i.e. V - c < s; a row never sent is not.
The worker can post the answer's receive before it sends the request (the wire's rule: no
handshake), because both ends know its size: the rows asked for and ceil(m / 8) bytes for the
worker's m cached rows on this server.
"""

from __future__ import annotations

import torch


def mask_bytes(m: int) -> int:
    """Bytes of the freshness bits of ``m`` cached rows."""
    return (m + 7) // 8


_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """A bool tensor (m,) as uint8 (ceil(m/8),), bit i of byte k holding flag 8k + i."""
    m = flags.numel()
    padded = torch.zeros(mask_bytes(m) * 8, dtype=torch.uint8)
    padded[:m] = flags.to(torch.uint8)
    return (padded.view(-1, 8) * _WEIGHTS).sum(1, dtype=torch.uint8) if m else padded


def unpack_bits(packed: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``m`` flags of ``packed`` as a bool tensor."""
    bits = (packed.view(-1, 1) & _WEIGHTS).ne(0)
    return bits.reshape(-1)[:m]


class CacheBook:
    """A server's record of its rows held in the workers' caches (see the module docstring):
    ``staleness`` is s; :meth:`announce` starts a worker's epoch for a table, :meth:`answer`
    records the rows a cached pull sends and returns the freshness bits for its answer."""

    def __init__(self, staleness: int):
        assert staleness >= 0
        self.staleness = staleness
        self.held: dict[
            tuple[int, int], tuple[torch.Tensor, torch.Tensor]
        ] = {}  # (worker, table) -> (local ids, sent at)

    def announce(self, worker: int, tid: int, local: torch.Tensor) -> None:
        """Worker ``worker`` caches rows ``local`` (this server's local ids, ascending) of table
        ``tid`` from now on, none of them sent yet (a new epoch: what it held before is dropped)."""
        assert local.numel() < 2 or bool((local[1:] > local[:-1]).all()), "announced rows must ascend"
        self.held[(worker, tid)] = (local, torch.full((local.numel(),), -1, dtype=torch.int64))

    def cached(self, worker: int, tid: int) -> int:
        """How many of this server's rows of ``tid`` the worker caches (0 before an announcement)."""
        entry = self.held.get((worker, tid))
        return 0 if entry is None else entry[0].numel()

    def answer(self, worker: int, tid: int, local: torch.Tensor | None, versions: torch.Tensor) -> torch.Tensor:
        """For a cached pull of rows ``local`` (None: every row) answered now, with the table
        shard's row ``versions``: record the version each requested cached row is sent at,
        and return the packed bits of the worker's cached rows readable on its next step."""
        entry = self.held.get((worker, tid))
        if entry is None or entry[0].numel() == 0:
            return torch.empty(0, dtype=torch.uint8)
        held, sent_at = entry
        asked = torch.arange(versions.numel()) if local is None else local
        if asked.numel():
            pos = torch.searchsorted(held, asked).clamp_(max=held.numel() - 1)
            hit = held[pos] == asked
            sent_at[pos[hit]] = versions[asked[hit]]
        fresh = (sent_at >= 0) & (versions[held] - sent_at < self.staleness)
        return pack_bits(fresh)
