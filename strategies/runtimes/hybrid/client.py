"""Worker side of the parameter server: placement, pull/push and bytes.

The wire format (one gloo message per request) is in ps_wire. Requests are PULL (row ids
of a table, or ``n = -1``: every row the server holds, for the ``ps`` strategy's
whole-parameter pulls and the final gather), PUSH (ids and gradient rows, or every row),
DONE (this worker pushed all of a step) and FINISH; with a hot-row cache (``--staleness``),
PULL_CACHED and CACHE for its tables (strategies/runtimes/hybrid/cache_client.py, which
:meth:`PSClient.pull_async` hands those pulls to). The server answers a pull with one
message tagged with the table's own tag (:func:`ps_wire.reply_tag`), whose receive the worker
posts before it sends the request.

Synchronous semantics: a pull of table T for step ``t`` is answered only after the server
applied T's updates of steps ``< t`` (the server defers it otherwise). The server applies
T's update of step ``t`` as soon as pushes representing all N workers are in (``count`` in
a push header is the number of workers it carries: 1, or a host's workers after local
aggregation), and at the latest once all N workers have sent ``DONE(t)`` (tables some
worker had no gradient for). Hence workers never read rows older than the previous step,
and never newer ones; a table whose gradients are complete early in the backward pass is
updated while the workers still compute.

Bytes are counted per table per step (DONE and FINISH under ``"_control"``), on both sides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpar.strategies.job.context import ByteMeter
from hpar.strategies.specs.decision import Plan
from hpar.strategies.runtimes.hybrid.shard import RowLayout, table_view
from hpar.strategies.job.optimizer_rules import OptimizerSpec
from hpar.strategies.plan.placement import embedding_weights, served_rules
from hpar.strategies.specs.servers_spec import ROW_PARTITIONS_PER_SERVER
from hpar.strategies.runtimes.hybrid.wire import (
    CONTROL,
    DONE,
    FINISH,
    PULL,
    PUSH,
    TAG_DATA,
    TAG_REQUEST,
    encode,
    nbytes,
    p2p,
    reply_tag,
)


@dataclass(frozen=True)
class PSTable:
    """One PS-placed parameter. ``rows x dim`` is its table view (ps_shard.table_view);
    ``kind`` is ``"rows"`` for nn.Embedding/nn.EmbeddingBag weights (pulled by touched rows)
    and ``"whole"`` for any other parameter (pulled and pushed whole, TensorFlow-PS style)."""

    tid: int
    name: str
    shape: tuple[int, ...]
    rows: int
    dim: int
    kind: str
    layout: RowLayout
    spec: OptimizerSpec
    dtype: torch.dtype = torch.float32


def ps_tables(
    model: torch.nn.Module, opt: torch.optim.Optimizer, strategy: str, plan: Plan, num_servers: int
) -> list[PSTable]:
    """The PS tables of ``model`` in ``named_parameters`` order (same on every process).

    ``opt`` is the user's optimizer, given all of ``model``'s parameters (a fine-tuning script
    keeps only the trainable ones; frozen ones are never served): each table takes its param
    group's rule (``strategies/plan/placement.served_rules``: ValueError if the PS cannot run
    it, or a served parameter is in no group). Partitions per parameter come
    from ``plan.partitions`` (fewer than the servers keeps a small table on fewer servers,
    so a worker sends it fewer requests). Without a planned count, an embedding table is cut
    into ``ROW_PARTITIONS_PER_SERVER`` partitions per server (at most one row each): a request
    goes to each server whatever the count, and fine slices spread a frequency-sorted
    vocabulary's head over every server; a table kept whole, one per server. Table ``t``'s partition 0
    lives on server ``t % S``, spreading the tables over the servers; ``plan.sparse_optimizer``
    picks ``"exact"`` (default) or ``"lazy"`` semantics (see ps_shard).
    """
    if num_servers < 1:
        raise ValueError("--servers must be at least 1 for --strategy hybrid/ps")
    emb = embedding_weights(model)
    tables = []
    for name, p, rule in served_rules(model, opt, strategy, plan):
        view = table_view(p.detach())
        default = num_servers * ROW_PARTITIONS_PER_SERVER if name in emb else num_servers
        parts = int(plan.partitions.get(name, default))
        tables.append(
            PSTable(
                len(tables),
                name,
                tuple(p.shape),
                view.shape[0],
                view.shape[1],
                "rows" if name in emb else "whole",
                RowLayout.make(view.shape[0], parts, num_servers, len(tables)),
                rule,
                p.dtype,
            )
        )
    return tables


def coalesce(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum gradient rows with equal ids: ``(unique ids (k,), summed rows (k, dim))``."""
    uids, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    out = grads.new_zeros(uids.numel(), grads.shape[1]).index_add_(0, inverse, grads)
    return uids, out


class PSClient:
    """A worker's connection to the S servers (ranks ``num_workers .. num_workers+S-1`` of
    ``group``, default: the default group)."""

    def __init__(
        self,
        tables: list[PSTable],
        num_workers: int,
        num_servers: int,
        is_remote: Callable[[int], bool] = lambda rank: False,
        pin: bool = False,
        group=None,
    ):
        self.tables, self.num_workers, self.num_servers = tables, num_workers, num_servers
        self.pin = pin  # answers land in pinned host memory (CUDA workers: async copies up)
        self.is_remote = is_remote  # default-group rank -> on another host than this worker
        self.bytes = ByteMeter()
        self.pull_s = 0.0  # seconds spent waiting in pulls since the caller last reset it
        self._server_rows = {t.tid: [t.layout.server_rows(s) for s in range(num_servers)] for t in tables}
        self._isend, self._irecv = p2p(group)
        self.caches = None  # cache_client.WorkerCaches with --staleness (it sets itself here)
        self.cache_off = False  # evaluate(): plain pulls, the cache neither read nor filled

    def holds(self, table: PSTable, server: int) -> bool:
        """Whether ``server`` holds rows of ``table``."""
        return bool(self._server_rows[table.tid][server].numel())

    def server_rank(self, server: int) -> int:
        return self.num_workers + server

    def _routes(self, table: PSTable, ids: torch.Tensor | None) -> list:
        """``[(server, where)]`` for every server holding rows of ``table``: ``where`` indexes
        the entries of ``ids`` that server owns (with ``ids`` None: the table rows it holds),
        or is None when a single server holds the whole table."""
        holders = [s for s in range(self.num_servers) if self._server_rows[table.tid][s].numel()]
        if len(holders) == 1:
            return [(holders[0], None)]
        if ids is None:
            return [(s, self._server_rows[table.tid][s]) for s in holders]
        owner = table.layout.server_of(ids)
        return [(s, (owner == s).nonzero().squeeze(1)) for s in holders]

    def _sent(self, server: int, name: str, n: int) -> None:
        self.bytes.add(name, sent=n, remote=self.is_remote(self.server_rank(server)))

    def _request(
        self,
        server: int,
        op: int,
        tid: int,
        n: int,
        step: int,
        name: str = CONTROL,
        count: int = 1,
        payload: tuple[torch.Tensor, ...] = (),
    ) -> list:
        """Send one request (ps_wire.encode); returns the pending sends."""
        msg, separate = encode(op, tid, n, step, count, payload)
        rank = self.server_rank(server)
        works = [self._isend(msg, rank, TAG_REQUEST)]
        self._sent(server, name, nbytes(msg))
        for t in separate:
            works.append(self._isend(t, rank, TAG_DATA))
            self._sent(server, name, nbytes(t))
        return works

    def pull(self, table: PSTable, ids: torch.Tensor | None, step: int) -> torch.Tensor:
        """Rows ``ids`` (unique 1-D int64) of ``table`` as of the start of ``step``, shape
        ``(len(ids), dim)``; every row (``(rows, dim)``) when ``ids`` is None. Blocks until
        every owning server has answered."""
        return self.pull_async(table, ids, step)()

    def pull_async(self, table: PSTable, ids: torch.Tensor | None, step: int):
        """Send the requests of :meth:`pull` and return a function that waits for the
        answers and returns the rows; several pulls in flight share one server wake-up. A
        table with a hot-row cache reads what it may from it (cache_client.WorkerCaches)."""
        if ids is not None and self.caches is not None and not self.cache_off and self.caches.cached(table):
            return self.caches.pull_async(table, ids, step)
        t0 = time.perf_counter()
        n_out = table.rows if ids is None else ids.numel()
        out = torch.empty(n_out, table.dim, dtype=table.dtype, pin_memory=self.pin)
        sends, recvs = [], []
        for s, where in self._routes(table, ids):
            sel = None if ids is None else (ids if where is None else ids[where])
            if sel is not None and sel.numel() == 0:
                continue
            buf = out if where is None else torch.empty(where.numel(), table.dim, dtype=table.dtype)
            # the answer's receive first, so the server can send it without a handshake
            recvs.append((self._irecv(buf, self.server_rank(s), reply_tag(table.tid)), where, buf))
            self.bytes.add(table.name, recv=nbytes(buf))
            sends += self._request(
                s,
                PULL,
                table.tid,
                -1 if sel is None else sel.numel(),
                step,
                table.name,
                payload=() if sel is None else (sel,),
            )
        self.pull_s += time.perf_counter() - t0

        def wait() -> torch.Tensor:
            t1 = time.perf_counter()
            for work in sends:
                work.wait()
            for work, where, buf in recvs:
                work.wait()
                if where is not None:
                    out[where] = buf
            self.pull_s += time.perf_counter() - t1
            return out

        return wait

    def push(self, table: PSTable, ids: torch.Tensor | None, grads: torch.Tensor, step: int, count: int = 1) -> list:
        """Send this worker's gradient rows for ``step``: ``grads`` is ``(len(ids), dim)``
        for unique ``ids``, or ``(rows, dim)`` when ``ids`` is None (whole parameter);
        ``count`` is the number of workers whose gradients it sums (local aggregation).
        Every server holding rows of the table gets a push, possibly empty, so it knows the
        parameter had a gradient. Returns the pending sends (wait on them)."""
        works = []
        for s, where in self._routes(table, ids):
            g = grads if where is None else grads[where]
            if ids is None:
                works += self._request(s, PUSH, table.tid, -1, step, table.name, count, (g,))
            else:
                sel = ids if where is None else ids[where]
                works += self._request(s, PUSH, table.tid, sel.numel(), step, table.name, count, (sel, g))
        return works

    def done(self, step: int) -> list:
        """Tell every server this worker pushed all its gradients of ``step`` (sent after
        the pushes on the same channel, so it arrives after them); returns the pending
        sends (wait on them)."""
        return [w for s in range(self.num_servers) for w in self._request(s, DONE, -1, 0, step)]

    def finish(self) -> None:
        """Tell every server this worker is finished (after its last pull)."""
        for work in [w for s in range(self.num_servers) for w in self._request(s, FINISH, -1, 0, 0)]:
            work.wait()


class LocalAggregator:
    """Parallax's local aggregation: the workers of one host sum their sparse gradients
    before the push, so the host's leader (its lowest worker rank) pushes the union of the
    rows once instead of every worker pushing its own (Kim et al., EuroSys 2019, sec. 4).
    It saves inter-host bytes when rows overlap across the host's workers; the exchange
    itself stays inside the host (an AllGather over the host's worker group)."""

    def __init__(self, group, ranks: list[int], rank: int, meter: ByteMeter):
        self.group, self.ranks, self.rank, self.bytes = group, ranks, rank, meter

    @property
    def leader(self) -> bool:
        return self.rank == min(self.ranks)

    def reduce(self, table: PSTable, grads: tuple[torch.Tensor, torch.Tensor] | None):
        """Collective over the host's workers: every worker passes its ``(ids, rows)`` of
        ``table`` (or None when its lookups got no gradient); the leader gets the summed
        ``(unique ids, rows)`` (None when no worker had a gradient), the others None."""
        ids, rows = grads if grads is not None else (torch.empty(0, dtype=torch.int64), None)
        if rows is None:
            rows = torch.empty(0, table.dim, dtype=table.dtype)
        size = torch.tensor([ids.numel() if grads is not None else -1], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in self.ranks]
        dist.all_gather(sizes, size, group=self.group)
        sizes = [int(s) for s in sizes]
        m = max(max(sizes), 0)
        peers = len(self.ranks) - 1
        if m:
            pid = torch.full((m,), -1, dtype=torch.int64)
            pid[: ids.numel()] = ids
            prow = rows.new_zeros(m, table.dim)
            prow[: ids.numel()] = rows
            all_ids = [torch.empty_like(pid) for _ in self.ranks]
            all_rows = [torch.empty_like(prow) for _ in self.ranks]
            dist.all_gather(all_ids, pid, group=self.group)
            dist.all_gather(all_rows, prow, group=self.group)
            self.bytes.add(
                "_local_aggregation",
                sent=(nbytes(pid) + nbytes(prow)) * peers,
                recv=(nbytes(pid) + nbytes(prow)) * peers,
            )
        if not self.leader or max(sizes) < 0:
            return None
        if m == 0:
            return torch.empty(0, dtype=torch.int64), rows.new_zeros(0, table.dim)
        cat_ids = torch.cat([i[: max(s, 0)] for i, s in zip(all_ids, sizes)])
        cat_rows = torch.cat([r[: max(s, 0)] for r, s in zip(all_rows, sizes)])
        return coalesce(cat_ids, cat_rows)
