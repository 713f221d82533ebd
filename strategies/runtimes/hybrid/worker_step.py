"""One training step of a hybrid/ps worker, for the training spine (strategies/runtimes/spine.py).

A step (strategies/runtimes/hybrid/hybrid_runtime.py describes the strategy)::

    pull the tables kept whole; zero the dense gradients
    for each of the --accumulate micro-steps:
        draw the batch; its rows requested ahead (ahead.prefetch)
        forward and backward (DDP's no_sync on all but the last micro-step); during the
            last one's backward the next step's rows are planned (PullAhead)
        push every served table's row gradients (from inside backward where possible)
    push the whole tables' gradients; fp16: the held pushes once every worker agrees the step
    is finite; DONE to the servers; clip by the norm that spans the servers
    the dense optimizer step, while the pushes are on the wire; wait for them

Its per-step state lives on the :class:`HybridStep`: ``pending`` (this step's sends to the
servers, awaited at its end), ``count`` (how many workers a push counts for: under
``--accumulate`` A every micro-step pushes its rows but only the last counts its worker, so the
servers apply the step once every worker's last push is in), ``copies`` (gradients on their way
to the host, pushed once there) and ``held`` (fp16: the step's pushes, held until every worker
agrees the step is finite: strategies/runtimes/hybrid/fp16.py).

Its checkpoint comes before its evaluation on the same step (``checkpoint_first``): the
servers wait in the checkpoint's commit barrier, where they could not answer the evaluation's
pulls of served rows; after every step the evaluation's bytes are forgotten (``after_step``).
"""

from __future__ import annotations

import contextlib
import itertools
import time

import torch

from hpar.strategies.common import activity, measured_memory as memory
from hpar.strategies.job.context import StepMeter, TrainResult, WorkerContext, batch_samples, move_to
from hpar.strategies.common.devices import to_device
from hpar.strategies.job.first_batch import check_first_batch, first_batch
from hpar.strategies.common.gather import all_gather_ints
from hpar.strategies.job.loop import step_tools
from hpar.strategies.runtimes.spine import StepOutcome, TrainStep
from hpar.strategies.runtimes.dataparallel.allreduce import ring_successor_remote
from hpar.strategies.runtimes.dataparallel.ddp import unused_error_named, wrap
from hpar.strategies.runtimes.dataparallel.compress_hooks import Compressor
from hpar.strategies.runtimes.dataparallel import sync_batchnorm
from hpar.strategies.runtimes.hybrid import ahead, build, embedding, fp16, worker_state
from hpar.strategies.runtimes.hybrid.client import LocalAggregator
from hpar.strategies.runtimes.hybrid.worker_parts import (
    WorkerParts,
    clip_with_servers,
    group_allreduce_hook,
    pull_ahead,
)
from hpar.strategies.job.forward import call_model
from hpar.strategies.state import state as run_state


class HybridStep(TrainStep):
    """A hybrid/ps worker's part of the training spine (module docstring); ``parts`` is what
    ``runtime._setup`` built. ``net`` is the model the forward runs through: DDP around
    ``outer`` when there are dense parameters, else ``outer``."""

    checkpoint_first = True

    def __init__(self, ctx: WorkerContext, parts: WorkerParts):
        super().__init__(ctx)
        self.parts, self.client, self.clock, self.served = parts, parts.client, parts.clock, parts.served
        self.opt, self.caches, self.loss_groups = parts.opt, parts.client.caches, parts.groups.workers
        self.ps_names = {t.name for t in parts.tables}
        self.tools = step_tools(
            ctx.cfg, ctx.job, parts.opt, ctx.device
        )  # the servers replay the schedule (hybrid/schedule.py)
        self.pending, self.count, self.copies = [], 1, []
        self.held = [] if ctx.cfg.precision == "fp16" else None
        self.scaled_opt = (parts.opt or fp16.placeholder_optimizer(ctx.device)) if self.held is not None else None
        self.totals, self.steps_done, self.eval_last = {}, 0, None
        self.compressor = Compressor(ctx.cfg.compress, ctx.cfg.steps, ctx.rank)  # --compress: the dense part's hook

    def resume(self) -> int:
        return worker_state.resume(
            self.ctx, self.parts.model, self.opt, self.tools, self.ps_names, self.caches, self.compressor
        )

    def model_copy(self, steps_done: int) -> torch.nn.Module:
        p = self.parts
        with sync_batchnorm.plain_batchnorm(p.model):  # worker 0 evaluates it alone
            return worker_state.model_copy(p.outer, self.client, p.whole, self.clock, steps_done, self.served)

    def begin(self) -> None:
        ctx, cfg, p = self.ctx, self.cfg, self.parts
        if (
            ctx.rank == 0 and cfg.eval and not cfg.resume and ctx.event is not None
        ):  # the served rows on demand, at step 0
            ctx.event({"kind": "phase", "phase": "evaluate"})  # not a stall (launcher/run/health.py)
            # evaluate()'s own peak is not training's (as workers/worker.py runs the other runtimes' first one)
            with (
                memory.outside_window(),
                torch.random.fork_rng(devices=[]),
                activity.doing("in evaluate() before training"),
            ):
                ctx.event({"kind": "first_eval", "eval": self.job.run_evaluate(self.model_copy(0))})
            worker_state.done_evaluating(self.client)
            ctx.event({"kind": "phase", "phase": "train"})
        groups = p.groups
        self.local = (
            LocalAggregator(groups.host, list(groups.host_ranks), ctx.rank, self.client.bytes) if groups.host else None
        )
        self.net = p.outer
        if p.dense:
            if cfg.sync_batchnorm:  # --sync-batchnorm: before DDP wraps the dense part
                sync_batchnorm.convert(p.model, groups.workers.dense, ctx.device)
            self.net = wrap(p.outer, groups.workers.dense, ctx.device, cfg.find_unused_parameters, ignore=self.ps_names)
            ring_remote = ring_successor_remote(ctx, list(range(ctx.world_size)))
            self.compressor.attach(
                self.net, (self.client.bytes, ctx.world_size, groups.workers.dense, ring_remote), group_allreduce_hook
            )
        drawn = self.job.batches(ctx.rank, ctx.world_size, cfg.batch_size)
        # past the batches trained on before the checkpoint (the same data as an uninterrupted run)
        first = (
            [first_batch(lambda i: next(drawn), ctx.start_step * cfg.accumulate)] if ctx.start_step < cfg.steps else []
        )
        if first:
            check_first_batch(ctx, first[0][0], groups.workers.control)  # equal sizes on every worker, before any step
        self.batches = ahead.PullAhead(self.served, self.client, itertools.chain(first, drawn))
        # without local aggregation (a collective), tables are pushed from inside backward
        self.clock.on_gradients = self._push if self.local is None and self.held is None else None

    # -- pushes: may run inside backward, never wait for the device --------------------------

    def _send(self, table, grads, count: int) -> None:
        if grads is None:
            return
        if self.held is not None:
            self.held.append((table, grads, count))
        else:
            self.pending.extend(self.client.push(table, grads[0], grads[1], self.clock.step, count=count))

    def _outgoing(self, table, grads):
        """A cached table's rows to push now (cache.RowCache.outgoing)."""
        return grads if self.caches is None else self.caches.outgoing(table, grads, self.clock.step)

    def _push(self, item) -> None:
        grads = item.host_gradients()
        if grads is not None:
            self.copies.append((item.table, grads))
        elif self.caches is not None:  # no gradient this step, but held ones may be due
            self._send(item.table, self._outgoing(item.table, None), self.count)
        self._send_copied(wait=False)
        self.batches.send()  # once this step's last table is pushed: the next step's rows

    def _send_copied(self, wait: bool) -> None:
        while self.copies and (wait or self.copies[0][1].ready()):
            table, grads = self.copies.pop(0)
            self._send(table, self._outgoing(table, grads.result()), self.count)

    # -- the step ----------------------------------------------------------------------------

    def step(self, step: int) -> StepOutcome:
        cfg, client, clock = self.cfg, self.client, self.clock
        clock.step = step
        if self.caches is not None:
            self.pending += self.caches.begin(step)  # a cache epoch starts: the servers hear its rows first
        for t, p in self.parts.whole:
            p.data.copy_(to_device(client.pull(t, None, step).reshape(p.shape), p.device))
            p.grad = None
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)
        step_loss, samples, push_s = 0.0, 0, 0.0
        for micro in range(cfg.accumulate):
            final = micro == cfg.accumulate - 1
            self.count = 1 if final else 0
            loss, n, output, targets = self._forward_backward(step, final)
            step_loss, samples = step_loss + loss, samples + n
            push_s += self._push_rows()
        t_push = time.perf_counter()
        skipped, lr = self._update(step)
        push_s += time.perf_counter() - t_push
        remote = client.bytes.take_remote()
        by_name = client.bytes.take()  # the PS tables' bytes and, under DENSE, the AllReduce's
        for k, (s, r) in by_name.items():
            acc = self.totals.setdefault(k, [0.0, 0.0])
            acc[0] += s
            acc[1] += r
        self.steps_done += 1
        logged = self.job.run_log(step + 1, output, targets) if self.ctx.rank == 0 else {}
        out = StepOutcome(
            step_loss,
            sum(s for s, _ in by_name.values()),
            sum(r for _, r in by_name.values()),
            sent_remote=remote,
            logged=logged,
            lr=lr,
            stepped=not skipped,
            samples=samples,
            extra={"pull_s": client.pull_s, "push_s": push_s},
        )
        client.pull_s = 0.0
        return out

    def _forward_backward(self, step: int, final: bool):
        """One micro-step's forward and backward; returns (its loss, samples, output, targets)."""
        cfg, net, outer, clock = self.cfg, self.net, self.parts.outer, self.clock
        inputs, targets = next(self.batches)
        samples = batch_samples(inputs)
        host_inputs = inputs
        inputs, targets = move_to(inputs, self.ctx.device), move_to(targets, self.ctx.device)
        clock.set_batch(host_inputs, inputs)  # ids are read on the host, never copied back
        ahead.prefetch(self.served, self.client, clock)
        with contextlib.nullcontext() if final or net is outer else net.no_sync():
            with (
                self.tools.autocast(),
                unused_error_named(net, self.ctx.event) if net is not outer else contextlib.nullcontext(),
            ):
                output = call_model(net, inputs)
                loss = self.job.compute_loss(output, targets) / cfg.accumulate
            if final and clock.on_gradients is not None and pull_ahead(cfg, step + 1, self.caches):
                self.batches.plan(step + 1)
            self.tools.backward(loss)  # scaled under fp16
        return loss.item(), samples, output, targets

    def _push_rows(self) -> float:
        """Push the micro-step's row gradients of every served table; returns the seconds."""
        t_push, local = time.perf_counter(), self.local
        for item in self.served:
            if local is not None:
                self._send(
                    item.table,
                    local.reduce(item.table, self._outgoing(item.table, item.gradients())),
                    len(local.ranks) * self.count,
                )
            elif not item.pushed:
                self._push(item)
            item.clear()
        self._send_copied(wait=True)
        self.batches.send(force=True)
        return time.perf_counter() - t_push

    def _update(self, step: int) -> tuple[bool, float | None]:
        """The step's end: the whole tables' pushes, fp16's agreement and held pushes, DONE,
        clipping, the dense update while the pushes are on the wire, then waiting for them.
        Returns (whether fp16 skipped the step, the lr the dense step used or None)."""
        client, tools, opt, held = self.client, self.tools, self.opt, self.held
        for t, p in self.parts.whole:
            if p.grad is not None:
                self._send(t, (None, p.grad.detach().to("cpu").reshape(t.rows, t.dim)), 1)
        skipped = held is not None and fp16.unscale_and_agree(
            tools.scaler, self.scaled_opt, [g for _, (_, g), _ in held], self.parts.groups.workers.control
        )
        for table, (ids, g), count in [] if skipped else held or []:  # a skipped step pushes nothing
            self.pending += client.push(table, ids, g, step, count=count)
        if held:
            held.clear()
        if self.caches is not None:
            self.caches.end_step(step)
        self.pending += client.done(step)
        if (
            self.cfg.clip_grad_norm
        ):  # the global norm spans the servers' rows: see strategies/runtimes/hybrid/ps_server.py
            clip_with_servers(self.ctx, self.parts.dense)
        lr = tools.lr(opt) if opt is not None else None
        if opt is not None:  # the dense update runs while the pushes are on the wire
            tools.step(opt, lambda: self.parts.dense, clip=False)
        elif self.scaled_opt is not None:  # ps under fp16: the scaler's update, on every worker alike
            tools.step(self.scaled_opt, lambda: [], clip=False)
        for work in self.pending:
            work.wait()
        self.pending.clear()
        return skipped, lr

    # -- around the steps --------------------------------------------------------------------

    def save(self, steps_done: int) -> None:
        worker_state.save(
            self.ctx, steps_done, self.parts.model, self.opt, self.tools, self.ps_names, self.caches, self.compressor
        )

    def after_step(self, steps_done: int) -> None:
        worker_state.done_evaluating(self.client)

    def write_final(self) -> None:
        ctx, p = self.ctx, self.parts
        if ctx.rank == 0:  # while the servers still answer: evaluate() reads served rows on demand
            if ctx.event is not None:
                ctx.event({"kind": "phase", "phase": "evaluate"})  # not a stall (launcher/run/health.py)
            with activity.doing("in evaluate() after the last step"):
                self.eval_last = self.job.run_evaluate(self.model_copy(self.cfg.steps)) if self.cfg.eval else {}
            worker_state.done_evaluating(self.client)
        self.client.finish()
        # the dense part where it lives (every worker holds it: DCP writes one copy); the servers write the tables
        on_servers = worker_state.served_names(p.model, self.ps_names)
        run_state.write_final(
            self.cfg.run_dir,
            {k: v for k, v in run_state.model_entries(p.model).items() if k[len("model.") :] not in on_servers},
        )
        embedding.detach(self.served)

    def result(self, meter: StepMeter) -> TrainResult:
        cfg, caches = self.cfg, self.caches
        # each worker's peak RSS over the run: training, evaluate(), the final write (int64 tensors, not pickles)
        peaks = [p for (p,) in all_gather_ints([build.peak_rss_bytes()], group=self.loss_groups.control)]
        n = max(self.steps_done, 1)
        by_param = {k: {"sent": v[0] / n, "recv": v[1] / n} for k, v in sorted(self.totals.items())}
        result = meter.result(
            None,
            replicas=self.ctx.world_size,
            extra={
                "by_param": by_param,
                "servers": cfg.servers or 1,
                "worker_peak_rss_bytes": peaks,
                "ps_params": sorted(self.ps_names),
                "pulls_ahead": self.batches.sent,
                **({"cache": caches.summary((cfg.plan.cache or {}).get("predicted_hit_rate"))} if caches else {}),
            },
        )
        result.eval_last = self.eval_last
        return result
