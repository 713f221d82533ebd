"""A worker's hot-row caches in a run: the requests of the cache protocol (strategies/runtimes/hybrid/
cache.py has the rules, versions.py the server's half), its epochs, and its part of the
checkpoints.

Requests (strategies/runtimes/hybrid/wire.py): ``CACHE`` (table, the cached rows a server holds, sent
to every server holding rows of the table at the start of an epoch, before any pull of it) and
``PULL_CACHED`` (the rows of a step's lookup that are not readable from the cache; its answer
is the rows and then the freshness bits of versions.py, one message whose size both ends
know). A server that gets no pull of a table from this worker in a step sends no bits for it,
so this worker's copies of its rows are not read on the next step (they are pulled, and so
refreshed): no news is never taken as fresh.

Evaluation (``evaluate()`` during and after training) reads the servers' rows with plain pulls
(``PSClient.cache_off``): it neither reads nor fills the cache, so it changes nothing in the
training (and a resumed run, which does not repeat it, stays bit-identical). The last step,
each step before a checkpoint and before each refresh push every held gradient, so evaluation
and checkpoints see the servers holding all of them.
"""

from __future__ import annotations

import time

import torch

from hpar.strategies.runtimes.hybrid.cache import RowCache

from hpar.strategies.specs.servers_spec import REFRESH_STEPS, CacheConfig
from hpar.strategies.runtimes.hybrid.versions import mask_bytes
from hpar.strategies.runtimes.hybrid.wire import CACHE, PULL_CACHED, nbytes, reply_tag


class WorkerCaches:
    """The caches of one worker (rank ``rank``) of a run of ``steps`` steps, one per served
    ``rows`` table of ``tables``; ``hot_rows`` maps a table's name to its rows by decreasing
    profiled frequency (the plan's ``cache["hot_rows"]``), the first epoch's rows; ``checkpoint_every`` the
    run's (a checkpoint ends an epoch); ``refresh_steps`` the steps between choices of the rows
    (the plan's ``cache["refresh_steps"]``, default cache.REFRESH_STEPS)."""

    def __init__(
        self,
        cfg: CacheConfig,
        tables,
        client,
        rank: int,
        steps: int,
        checkpoint_every: int = 0,
        hot_rows: dict | None = None,
        refresh_steps: int = REFRESH_STEPS,
    ):
        self.cfg, self.client, self.rank, self.steps, self.checkpoint_every = cfg, client, rank, steps, checkpoint_every
        self.refresh_steps = max(1, int(refresh_steps))
        self.caches: dict[int, RowCache] = {}
        for t in tables:
            if t.kind != "rows":
                continue
            cap = cfg.rows_for(t.rows)
            first = torch.tensor([int(i) for i in (hot_rows or {}).get(t.name, [])[:cap]], dtype=torch.int64)
            self.caches[t.tid] = RowCache(t, first.clamp(0, t.rows - 1), cap, cfg.staleness)
        self.next = {tid: c.ids for tid, c in self.caches.items()}  # the coming epoch's rows
        self.reset_due = True
        client.caches = self

    def boundary(self, step: int) -> bool:
        """Whether ``step`` (0-based) starts an epoch: a refresh, a checkpoint's step, or past the last step."""
        return (
            step % self.refresh_steps == 0
            or step >= self.steps
            or bool(self.checkpoint_every and step % self.checkpoint_every == 0)
        )

    def flush(self, step: int) -> bool:
        """Whether ``step`` pushes every held gradient: the last step of an epoch."""
        return self.boundary(step + 1)

    def begin(self, step: int) -> list:
        """Before any pull of ``step``: start an epoch where one is due (tell the servers the
        rows, CACHE). Returns the pending sends."""
        if not self.reset_due:
            return []
        self.reset_due = False
        works = []
        for tid, cache in self.caches.items():
            cache.new_epoch(self.next[tid])
            table, client = cache.table, self.client
            for s in range(client.num_servers):
                if client.holds(table, s):
                    ids = cache.ids[cache.on_server[s]]
                    works += client._request(s, CACHE, tid, ids.numel(), step, table.name, payload=(ids,))
        return works

    def end_step(self, step: int) -> None:
        """After ``step``'s pushes: where the next step starts an epoch, choose its rows."""
        if self.boundary(step + 1):
            refresh = (step + 1) % self.refresh_steps == 0
            self.next = {tid: c.next_rows(refresh) for tid, c in self.caches.items()}
            self.reset_due = True

    def outgoing(self, table, grads, step: int):
        """What to push of ``table`` on ``step`` given this micro-step's gradients (cache.RowCache.outgoing);
        ``grads`` as they are for a table without a cache."""
        cache = self.caches.get(table.tid)
        return grads if cache is None else cache.outgoing(grads, self.flush(step))

    def cached(self, table) -> bool:
        return table.tid in self.caches

    def pull_async(self, table, ids: torch.Tensor, step: int):
        """``PSClient.pull_async`` for a cached table: the rows readable from the cache now, the
        others pulled (``PULL_CACHED``); the waiter stores the pulled cached rows and the bits."""
        client, cache = self.client, self.caches[table.tid]
        t0 = time.perf_counter()
        hit, slot = cache.split(ids, step)
        member = cache.slots(ids)[0]
        out = torch.empty(ids.numel(), table.dim, dtype=table.dtype, pin_memory=client.pin)
        if bool(hit.any()):
            out[hit] = cache.values[slot[hit]]
        miss_at = (~hit).nonzero().squeeze(1)
        miss = ids[miss_at]
        row_bytes = table.dim * torch.empty(0, dtype=table.dtype).element_size()
        sends, recvs, epoch = [], [], cache.epoch
        for s, where in client._routes(table, miss):
            sel, at = (miss, miss_at) if where is None else (miss[where], miss_at[where])
            if sel.numel() == 0:
                continue
            buf = torch.empty(sel.numel() * row_bytes + mask_bytes(cache.on_server[s].numel()), dtype=torch.uint8)
            recvs.append((client._irecv(buf, client.server_rank(s), reply_tag(table.tid)), s, sel, at, buf))
            client.bytes.add(table.name, recv=nbytes(buf))
            sends += client._request(s, PULL_CACHED, table.tid, sel.numel(), step, table.name, payload=(sel,))
        client.pull_s += time.perf_counter() - t0

        def wait() -> torch.Tensor:
            t1 = time.perf_counter()
            for work in sends:
                work.wait()
            for work, s, sel, at, buf in recvs:
                work.wait()
                k = sel.numel() * row_bytes
                rows = buf[:k].view(table.dtype).view(sel.numel(), table.dim)
                out[at] = rows
                if cache.epoch == epoch:
                    cache.fill(sel, rows, (member[at], slot[at]))
                    cache.readable(s, buf[k:], step)
            client.pull_s += time.perf_counter() - t1
            return out

        return wait

    def entries(self) -> dict:
        """This worker's cache rows for the next epoch, in the checkpoint namespace
        (``cache.worker<rank>.<table>``, padded to the capacity; strategies/state/state.py)."""
        out = {}
        for tid, cache in self.caches.items():
            padded = torch.full((cache.capacity,), -1, dtype=torch.int64)
            padded[: self.next[tid].numel()] = self.next[tid]
            out[f"cache.worker{self.rank}.{cache.table.name}"] = padded
        return out

    def restore(self, path: str) -> None:
        """Take the next epoch's rows from the checkpoint in ``path`` where it holds this
        worker's at this capacity (a worker that did not exist then, or a cache of another
        size, keeps the profile's hottest rows)."""
        from hpar.strategies.state import safe_read, state as run_state

        saved = safe_read.read_metadata(path).state_dict_metadata  # as data, not code
        want = {
            k: v
            for k, v in self.entries().items()
            if k in saved and tuple(getattr(saved[k], "size", ())) == tuple(v.shape)
        }
        if not want:
            return
        run_state.read(path, want)
        for tid, cache in self.caches.items():
            ids = want.get(f"cache.worker{self.rank}.{cache.table.name}")
            if ids is not None:
                self.next[tid] = ids[ids >= 0]

    def summary(self, predicted: float | None = None) -> dict:
        """The cache's figures for summary.json: staleness, rows per table, the hit rate (rows
        read from the cache over the rows looked up in training), overall and per table, and
        the ``predicted`` hit rate beside it (the plan's, strategies/plan/costmodel_cache.py)."""
        by = {
            c.table.name: {"rows": c.capacity, "hit_rate": c.hits / c.lookups if c.lookups else 0.0}
            for c in self.caches.values()
        }
        hits, looked = sum(c.hits for c in self.caches.values()), sum(c.lookups for c in self.caches.values())
        return {
            "staleness": self.cfg.staleness,
            "hit_rate": hits / looked if looked else 0.0,
            "predicted_hit_rate": predicted,
            "tables": by,
        }
