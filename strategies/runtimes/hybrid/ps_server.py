"""A parameter server: its shard of every table and the loop that answers the workers
(the process around it is workers/server.py).

It answers the wire protocol of strategies/runtimes/hybrid/client.py (strategies/runtimes/hybrid/wire.py)
until every worker has finished: pulls (deferred until the previous step is applied),
pushes (accumulated; a table's update is applied as soon as pushes from all workers are in;
a push of a step the table has not reached, which an empty push to a server the worker pulled
no rows from can be, overtaking another worker's push of the step before, waits for that step),
DONE (close the step once all workers are done: apply the tables not yet applied, checkpoint
when due). Bytes per step by table go out through the ``emit`` it is given (``metric``).
With the workers' hot-row caches (``--staleness``), each shard counts its rows' versions, and
the server keeps which rows each worker caches (``CACHE``) and answers ``PULL_CACHED`` with
the rows and their freshness bits (strategies/runtimes/hybrid/versions.py).
The request probe runs one in a thread to measure what a request costs (strategies/plan/probe.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from hpar.strategies.common import activity, measured_memory as memory

from hpar.strategies.state import checkpoint
from hpar.strategies.state import state as run_state
from hpar.strategies.job.config import RunConfig
from hpar.strategies.job.context import ByteMeter
from hpar.strategies.runtimes.hybrid.client import PSTable
from hpar.strategies.runtimes.hybrid.schedule import ServerSchedule
from hpar.strategies.runtimes.hybrid.shard import ParamShard, table_view
from hpar.strategies.runtimes.hybrid.shard_state import server_entries, set_steps
from hpar.strategies.job.tying import shared_parameters
from hpar.strategies.runtimes.hybrid.versions import CacheBook
from hpar.strategies.runtimes.hybrid.wire import (
    CACHE,
    CONTROL,
    DONE,
    FINISH,
    HEADER_BYTES,
    PULL,
    PULL_CACHED,
    PUSH,
    Inbox,
    Request,
    nbytes,
    p2p,
    reply_tag,
)
from hpar.strategies.specs.servers_spec import INBOX_DEPTH
from hpar.strategies.job.loop import clip_coefficient


class Server:
    """Server ``index`` of ``num_servers``, holding its rows of every table. ``group`` is the
    process group of its requests and answers (default: the default group, where workers hold
    ranks ``0..num_workers-1``); ``emit(kind, payload)`` takes its ``metric`` lines;
    ``is_remote(rank)`` whether a default-group rank runs on another host (its bytes leave the
    host: context.peer_is_remote). It starts at step 0; :meth:`restore` moves it to a
    checkpoint's step."""

    def __init__(
        self,
        cfg: RunConfig,
        tables: list[PSTable],
        model: torch.nn.Module,
        index: int,
        num_workers: int,
        is_remote: Callable[[int], bool] = lambda rank: False,
        schedule: ServerSchedule | None = None,
        group_of: dict[int, int] | None = None,
        group=None,
        emit: Callable[[str, dict], None] = lambda kind, payload: None,
    ):
        self.cfg, self.tables, self.index, self.num_workers = cfg, {t.tid: t for t in tables}, index, num_workers
        self.schedule, self.group_of = schedule, group_of or {}  # table id -> the user's param group
        params = dict(model.named_parameters())
        shared = shared_parameters(model)  # a table's other names (tied weights), written with it
        self.aliases = {t.name: [n for n in shared.get(t.name, []) if n != t.name] for t in tables}
        self.shards: dict[int, ParamShard] = {}
        for t in tables:
            rows = t.layout.server_rows(index)
            if rows.numel():  # the model is dropped after this: its rows are taken, not copied again
                view = table_view(params[t.name].detach())
                self.shards[t.tid] = ParamShard(
                    view if rows.numel() == view.shape[0] else view[rows], t.spec, copy=False
                )
        self.applied = 0  # steps closed (every worker sent DONE)
        self.table_step = {tid: 0 for tid in self.shards}  # steps applied, per table
        self.pushed = {tid: 0 for tid in self.shards}  # workers whose gradients are in, per table
        self.done: dict[int, int] = {}
        self.pending: list[
            tuple[int, int, torch.Tensor | None, int, bool]
        ] = []  # (src, table, local ids, step, cached)
        # pushes of a step the table has not reached (tid, step, local ids, rows, count): a push goes to
        # every server holding rows of the table, also one whose rows the worker did not pull this
        # step; such an empty push has no answered pull before it, and can arrive while another
        # worker's push of the step before is still on its way
        self.early: list[tuple[int, int, torch.Tensor | None, torch.Tensor, int, int]] = []
        self.bytes = ByteMeter()
        self.totals: dict[str, list[float]] = {}
        self.interval = {"steps": 0, "remote": 0.0, "by_param": {}}  # bytes since the last report
        self.is_remote = is_remote
        self.book = CacheBook(cfg.staleness) if cfg.staleness is not None else None  # the workers' caches
        for shard in self.shards.values() if self.book else ():
            shard.track_versions()
        self.emit = emit  # (kind, payload): the process's report lines (workers/report.emit)
        self._isend = p2p(group)[0]
        self.inbox = Inbox(num_workers, INBOX_DEPTH, cfg.steps, group)

    def _entries(self, keys: set[str] | None = None) -> dict:
        """This server's tables and slots in the checkpoint namespace (shard_state.py)."""
        return server_entries(self.tables, self.shards, self.index, lambda s: self.num_workers + s, keys, self.aliases)

    def write_final(self) -> None:
        """Write this server's rows of every table into the run's final model (a collective
        with the workers, once they finished: strategies/state.write_final)."""
        run_state.write_final(self.cfg.run_dir, {k: v for k, v in self._entries().items() if k.startswith("model.")})

    def restore(self, run_dir: str, step: int) -> None:
        """Load the rows this server holds now, in its layout, from checkpoint ``step``
        (whatever numbers of servers and partitions wrote it: DCP reshards)."""
        path = checkpoint.step_dir(run_dir, step)
        entries = self._entries(run_state.saved_keys(path))
        run_state.read(path, entries)
        set_steps(self.tables, self.shards, entries)
        self.applied = step
        self.table_step = {tid: step for tid in self.shards}

    def _reply(self, src: int, tid: int, local: torch.Tensor | None, cached: bool = False) -> None:
        """Answer a pull: the rows, and for a cached pull the freshness bits behind them."""
        shard = self.shards[tid]
        rows = shard.lookup(local).contiguous()
        if cached:
            bits = self.book.answer(src, tid, local, shard.versions)
            rows = torch.cat([rows.reshape(-1).view(torch.uint8), bits])
        self.bytes.add(self.tables[tid].name, sent=nbytes(rows), remote=self.is_remote(src))
        self._isend(rows, src, reply_tag(tid)).wait()

    def _take(self, req: Request, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = self.inbox.take(req, shape, dtype)
        self.bytes.add(self.tables[req.tid].name, recv=nbytes(t))
        return t

    def _local_ids(self, req: Request) -> torch.Tensor | None:
        """The request's row ids as this server's local row indices; None for every row."""
        if req.n < 0:
            return None
        return self.tables[req.tid].layout.local_index(self.index, self._take(req, (req.n,), torch.int64))

    def _apply_table(self, tid: int) -> None:
        """Apply table ``tid``'s update of its current step (a no-op without pushes) and
        answer the pulls that waited for it."""
        shard = self.shards[tid]
        spec = self.schedule.spec(self.group_of[tid], self.table_step[tid], shard.spec) if self.schedule else None
        shard.apply(self.num_workers, spec)
        self.table_step[tid] += 1
        self.pushed[tid] = 0
        self._take_early()
        self._answer_pending()

    def _apply_clipped(self) -> None:
        """``--clip-grad-norm``: the step's mean gradients of every open table, scaled by the
        global clipping coefficient, applied. The global sum of squares is one AllReduce over
        the default group: each server adds its shards' part, worker 0 the dense part
        (strategies/runtimes/hybrid/worker_parts.clip_with_servers makes the same call after its DONE)."""
        open_tables = [tid for tid, at in self.table_step.items() if at == self.applied]
        specs, grads = {}, {}
        for tid in open_tables:
            shard = self.shards[tid]
            specs[tid] = self.schedule.spec(self.group_of[tid], self.applied, shard.spec) if self.schedule else None
            grads[tid] = shard.mean_gradient(self.num_workers, specs[tid])
        total = torch.tensor(
            [sum(float(g[1].double().pow(2).sum()) for g in grads.values() if g is not None)], dtype=torch.float64
        )
        dist.all_reduce(total)
        coef = clip_coefficient(float(total), self.cfg.clip_grad_norm)
        for tid in open_tables:
            if grads[tid] is not None:
                grads[tid][1].mul_(coef)
            self.shards[tid].apply_gradient(grads[tid], specs[tid])
            self.table_step[tid] += 1
            self.pushed[tid] = 0
        self._take_early()
        self._answer_pending()

    def _apply_if_complete(self, tid: int) -> None:
        """Apply table ``tid`` early when all workers' gradients of the open step are in.
        (Pushes of a later step can already be complete with local aggregation, whose
        leader may push before its host's other worker's DONE arrives; they wait for the
        step to close, so a checkpoint never holds a table ahead of its step.)"""
        if (
            self.pushed[tid] == self.num_workers
            and self.table_step[tid] == self.applied
            and not self.cfg.clip_grad_norm
        ):
            self._apply_table(tid)

    def _take_early(self) -> None:
        """Add the early pushes of the step each table is now at (the table was just applied;
        the step's own early apply, if due, follows from :meth:`_close_step`)."""
        now = [e for e in self.early if e[1] == self.table_step[e[0]]]
        self.early = [e for e in self.early if e[1] != self.table_step[e[0]]]
        for tid, _, local, grads, count, src in now:
            self._add_push(tid, local, grads, count, src)

    def _add_push(self, tid: int, local: torch.Tensor | None, grads: torch.Tensor, count: int, src: int) -> None:
        """Add one push (``count`` workers' gradients of rows ``local``, None: all) from worker
        ``src`` to table ``tid`` (summed in the workers' order, shard.ParamShard.add_grad)."""
        self.shards[tid].add_grad(local, grads, sender=src)
        self.pushed[tid] += count

    def _answer_pending(self) -> None:
        still = []
        for src, tid, local, at, cached in self.pending:
            if at <= self.table_step[tid]:
                self._reply(src, tid, local, cached)
            else:
                still.append((src, tid, local, at, cached))
        self.pending = still

    def _close_step(self) -> None:
        """Every worker sent DONE for step ``applied``: apply the tables still open, report
        the step's bytes and checkpoint when due."""
        if self.cfg.clip_grad_norm:
            self._apply_clipped()
        for tid, at in self.table_step.items():
            if at == self.applied:
                self._apply_table(tid)
        self.applied += 1
        step = self.applied
        self._count_step(self.bytes.take(), self.bytes.take_remote())
        memory.release_freed_memory_paced()  # the step's freed pushes back to the system (at most 1% of the time)
        if step % self.cfg.log_every == 0 or step == self.cfg.steps:
            self._report(step)
        if self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0:
            run_state.save(self.cfg.run_dir, step, self._entries(), keep=self.cfg.keep_checkpoints)
        for tid in self.shards:
            self._apply_if_complete(tid)

    def _count_step(self, by_name: dict, remote: float) -> None:
        it = self.interval
        it["steps"] += 1
        it["remote"] += remote
        for k, (s, r) in by_name.items():
            for acc in (self.totals.setdefault(k, [0.0, 0.0]), it["by_param"].setdefault(k, [0.0, 0.0])):
                acc[0] += s
                acc[1] += r

    def _report(self, step: int) -> None:
        """One ``metric`` line: bytes per step (sent, received, sent to other hosts, and by
        parameter), averaged over the steps closed since the previous report."""
        it, n = self.interval, max(self.interval["steps"], 1)
        self.emit(
            "metric",
            {
                "step": step,
                "server": self.index,
                "bytes_sent": sum(s for s, _ in it["by_param"].values()) / n,
                "bytes_recv": sum(r for _, r in it["by_param"].values()) / n,
                "bytes_sent_remote": it["remote"] / n,
                "by_param": {k: {"sent": s / n, "recv": r / n} for k, (s, r) in it["by_param"].items()},
            },
        )
        self.interval = {"steps": 0, "remote": 0.0, "by_param": {}}

    def describe(self, req: Request) -> str:
        """What handling ``req`` is, for the launcher's phase deadline (strategies/common/activity.py)."""
        what = {
            PULL: "pull",
            PULL_CACHED: "pull",
            CACHE: "cached rows",
            PUSH: "push",
            DONE: "end of step",
            FINISH: "finish",
        }.get(req.op, f"request {req.op}")
        table = (
            f" of {self.tables[req.tid].name}"
            if req.op in (PULL, PULL_CACHED, CACHE, PUSH) and req.tid in self.tables
            else ""
        )
        return f"handling worker {req.src}'s {what}{table} (step {req.step})"

    def serve(self) -> None:
        """Answer requests until every worker sent FINISH. Handling one request (applying a
        table's update when it completes one, answering the pulls that waited for it, writing
        a checkpoint when due) has the phase deadline; waiting for the next one has none."""
        finished = 0
        while finished < self.num_workers:
            req = self.inbox.next()
            with activity.doing(self.describe(req), announce=False):
                finished += self._handle(req)
        assert not self.pending, "a pull was left unanswered"
        assert not self.early, "a push was left unapplied"
        self.inbox.close()

    def _handle(self, req: Request) -> int:
        """Handle one request; 1 for a worker's FINISH, else 0."""
        op, tid, step = req.op, req.tid, req.step
        self.bytes.add(CONTROL if op in (DONE, FINISH) else self.tables[tid].name, recv=HEADER_BYTES)
        if op in (PULL, PULL_CACHED):
            local = self._local_ids(req)
            if step <= self.table_step[tid]:
                self._reply(req.src, tid, local, op == PULL_CACHED)
            else:
                self.pending.append((req.src, tid, local, step, op == PULL_CACHED))
        elif op == CACHE:  # a worker's cache epoch: the rows of this shard it caches from now on
            self.book.announce(req.src, tid, self._local_ids(req))
        elif op == PUSH:
            local = self._local_ids(req)
            rows = self.shards[tid].weight.shape[0] if local is None else local.numel()
            grads = self._take(req, (rows, self.tables[tid].dim), self.tables[tid].dtype)
            if step > self.table_step[tid]:
                self.early.append((tid, step, local, grads, req.count, req.src))
            else:
                assert step == self.table_step[tid], (
                    f"push for step {step} while table {tid} is at {self.table_step[tid]}"
                )
                self._add_push(tid, local, grads, req.count, req.src)
                self._apply_if_complete(tid)
        elif op == DONE:
            self.done[step] = self.done.get(step, 0) + 1
            while self.done.get(self.applied, 0) == self.num_workers:
                del self.done[self.applied]
                self._close_step()
        elif op == FINISH:
            return 1
        else:
            raise AssertionError(f"unknown op {op} from rank {req.src}")
        return 0
