"""Hybrid data parallelism (Parallax) and the parameter-server peer: the ``hybrid`` and
``ps`` runtimes.

Kim et al., "Parallax: Sparsity-aware Data Parallel Training of Deep Neural Networks"
(EuroSys 2019): sparse parameters (embedding tables, whose gradients touch few rows) live
row-partitioned on parameter servers; dense parameters are averaged with AllReduce.

Each step a worker (1) pulls the deduplicated rows its batch touches, inside the embedding
modules' forward (hybrid/embedding.py), (2) runs forward and backward locally; DDP over the
worker-only process group averages the dense gradients, bucketed and overlapped with
backward, (3) pushes (row ids, row gradients) to the owning servers and tells them it is
done with the step; the servers apply the step once every worker is done. ``ps``: every
parameter lives on the servers, dense ones pulled and pushed whole (TensorFlow-PS style).

Round trips: rows of embeddings fed straight from the batch, or with the same tensor as
another served embedding, are requested before they are needed (ahead.prefetch),
so a step's pulls share one server wake-up; those fed from the batch are requested during the
step before, once its last push left (ahead.PullAhead). A table's push leaves from inside backward as soon
as its gradients are complete, and the server applies a table once every worker's push is in,
so the sampled-softmax tables are updated while the workers still run the LSTM's backward;
pushes and DONE are asynchronous and overlap the dense optimizer step. Workers on one host
aggregate sparse gradients before pushing when a server lives on another host
(ps_client.LocalAggregator).

Scaling: sparse gradients are *averaged* over workers on the server (sum of pushes / N),
as DDP averages the dense ones; so N workers with a mean loss each match one process on
the concatenated batch with a mean loss (equal per-worker batch sizes).

Hot rows (``--staleness s``): each worker caches a served table's hottest rows, reads a copy
while it is at most s updates behind the servers' and holds a cached row's gradients back for
at most s steps (HET, VLDB 2022: strategies/hybrid/cache.py); s = 0 trains as without it.

Checkpoints: the part ``worker0`` holds the dense parameters, the worker optimizer state
and every worker's RNG state; ``server{i}`` parts hold the shards and their optimizer state.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpar.strategies.common import activity, memory

from hpar.strategies.runstate import checkpoint
from hpar.strategies.runstate import state as run_state
from hpar.strategies.hybrid import ahead, build, embedding
from hpar.strategies.hybrid.cache import REFRESH_STEPS, CacheConfig
from hpar.strategies.hybrid.cache_client import WorkerCaches
from hpar.strategies.dataparallel.allreduce import DENSE, ring_allreduce_bytes, ring_successor_remote, set_sparse_gradients
from hpar.strategies.dataparallel.ddp import unused_error_named, wrap
from hpar.strategies.common.devices import cpu_copy, to_device
from hpar.strategies.common.groups import WorkerGroups, mean_over_workers, worker_groups
from hpar.strategies.common.first_batch import check_first_batch, first_batch
from hpar.strategies.common.gather import all_gather_ints
from hpar.strategies.common.context import StepMeter, TrainResult, WorkerContext, batch_samples, move_to
from hpar.strategies.models.forward import call_model, inner_module
from hpar.strategies.common.loop import clip_coefficient, evaluate_during_training, evaluate_now, step_tools
from hpar.strategies.hybrid.client import LocalAggregator, PSClient, ps_tables
from hpar.strategies.models.tying import shared_parameters
from hpar.strategies.hybrid import fp16


@dataclass(frozen=True)
class Groups:
    """Process groups every process of a hybrid/ps run creates, in the same order:
    ``workers`` (the workers' dense and control groups, strategies/common/groups.py: the dense
    AllReduce on NCCL when CUDA, CPU values on gloo) and, where local aggregation is on,
    one gloo group per host with several workers; ``host``/``host_ranks`` are this process's."""
    workers: WorkerGroups
    host: object = None
    host_ranks: tuple[int, ...] = ()


def make_groups(num_workers: int, device_type: str, hosts: tuple[int, ...], plan: dict) -> Groups:
    """Create the run's subgroups: a collective over the default group, so servers call it
    too, with the same arguments (``hosts``: the host index of every default-group rank,
    from ``workers.worker.init_group``). Local aggregation is on for a host with several
    workers when a server lives on another host (its pushes then cross the network), or as
    ``plan["local_aggregation"]`` (true/false) says."""
    workers = worker_groups(num_workers, device_type)
    worker_hosts, server_hosts = hosts[:num_workers], hosts[num_workers:]
    want = (plan or {}).get("local_aggregation")
    mine, my_ranks = None, ()
    for h in sorted(set(worker_hosts)):
        ranks = [r for r in range(num_workers) if worker_hosts[r] == h]
        on = any(sh != h for sh in server_hosts) if want is None else bool(want)
        if len(ranks) < 2 or not on:
            continue
        group = dist.new_group(ranks, backend="gloo")
        if dist.get_rank() in ranks:
            mine, my_ranks = group, tuple(ranks)
    return Groups(workers=workers, host=mine, host_ranks=my_ranks)


def group_allreduce_hook(state, bucket):
    """DDP communication hook: mean AllReduce of the bucket over the worker group (the
    default group also holds the servers), counting ring bytes 2(N-1)/N * B per worker.
    ``state``: (ByteMeter, N, the worker group, whether the ring successor is on another host)."""
    counter, world_size, group, remote = state
    buf = bucket.buffer()
    b = ring_allreduce_bytes(buf.numel() * buf.element_size(), world_size)
    counter.add(DENSE, sent=b, recv=b, remote=remote)
    buf.div_(world_size)
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def _setup(ctx: WorkerContext):
    """Build the model on the ``meta`` device, hand its served tables to the parameter server
    (their weights emptied), give the rest storage on the worker's device and the initial
    values from server 0 (hybrid/build.py): a served table is never materialised on a worker,
    neither on its device nor in its host memory (tables larger than a GPU's, or a worker's,
    memory are what servers are for). The forward runs through ``outer``, as ``model()`` returned
    it (a ``torch.compile`` wrapper stays); surgery and names use the module inside (:func:`inner_module`)."""
    cfg, job = ctx.cfg, ctx.job
    outer, on_meta = build.build_model(job, cfg.seed)
    model = inner_module(outer)
    set_sparse_gradients(model, False)
    full_opt = job.build_optimizer(model.parameters(), cfg.lr)
    servers = cfg.servers or 1
    tables = ps_tables(model, full_opt, cfg.strategy, cfg.plan, servers)
    del full_opt
    groups = make_groups(ctx.world_size, cfg.device, ctx.host_of, cfg.plan)
    client = PSClient(tables, ctx.world_size, servers, ctx.is_remote, pin=ctx.device.type == "cuda")
    if cfg.staleness is not None:   # the hot-row caches (client.caches)
        planned = (cfg.plan or {}).get("cache") or {}
        WorkerCaches(CacheConfig(cfg.cache_rows, cfg.staleness), tables, client, ctx.rank, cfg.steps,
                     cfg.checkpoint_every, planned.get("hot_rows"), planned.get("refresh_steps", REFRESH_STEPS))
    clock = embedding.StepClock()
    served = embedding.attach(model, [t for t in tables if t.kind == "rows"], client, clock)
    if on_meta:
        build.to_empty_keeping_ties(model, ctx.device)   # storage for the dense part only: the tables are empty
    else:
        model.to(ctx.device)
    build.broadcast_dense(model, {t.name for t in tables}, src=ctx.world_size)   # from server 0
    params = dict(model.named_parameters())
    whole = [(t, params[t.name]) for t in tables if t.kind == "whole"]
    ps_names = {t.name for t in tables}
    dense = [p for n, p in model.named_parameters() if n not in ps_names]
    opt = job.build_optimizer(dense, cfg.lr) if dense else None
    return outer, model, tables, groups, client, clock, served, whole, dense, opt


def served_names(model, ps_names: set[str]) -> frozenset:
    """Every name under which the model's state_dict holds a parameter the servers hold (a
    tied weight has several): the servers write those, not the workers."""
    shared = shared_parameters(model)
    return frozenset(ps_names) | {alias for n in ps_names for alias in shared.get(n, [])}


def _save(ctx: WorkerContext, step: int, model, opt, tools, ps_names: set[str], caches) -> None:
    """This worker's state (its dense part: the servers write the tables; the next epoch's
    cached rows) in the step's checkpoint, with the servers' (strategies/runstate/state.py); a
    collective over the default group."""
    run_state.save(ctx.cfg.run_dir, step, {**run_state.process_entries(
        model, opt, tools if opt else None, ctx.device, f"worker{ctx.rank}", "workers", served_names(model, ps_names)),
        **(caches.entries() if caches else {})}, keep=ctx.cfg.keep_checkpoints)


def _resume(ctx: WorkerContext, model, opt, tools, ps_names: set[str], caches) -> int:
    step = checkpoint.latest_step(ctx.cfg.run_dir) if ctx.cfg.resume else None
    if step is None:
        return 0
    run_state.restore_process(ctx.cfg.run_dir, step, model, opt, tools if opt else None, ctx.device,
                              f"worker{ctx.rank}", "workers", served_names(model, ps_names))
    if caches:
        caches.restore(checkpoint.step_dir(ctx.cfg.run_dir, step))
    return step


def _clip_with_servers(ctx: WorkerContext, dense: list[torch.Tensor]) -> None:
    """``--clip-grad-norm`` under hybrid/ps: one AllReduce over the default group (workers and
    servers, after this worker's DONE) sums the squares of the whole averaged gradient (worker
    0 adds the dense part, identical on every worker after DDP; each server its rows), then
    the dense gradients are scaled by torch's clipping coefficient, as the servers do theirs."""
    sq = sum(float(p.grad.double().pow(2).sum()) for p in dense if p.grad is not None) if ctx.rank == 0 else 0.0
    total = torch.tensor([sq], dtype=torch.float64)
    dist.all_reduce(total)
    coef = clip_coefficient(float(total), ctx.cfg.clip_grad_norm)
    for p in dense:
        if p.grad is not None:
            p.grad.mul_(coef)


# Served tables up to this many bytes in all are pulled whole into evaluate()'s copy, so that
# an evaluate() reading a table's .weight directly (examples/lm.py's full softmax) sees it;
# larger ones stay served row by row, so that no process ever holds them whole (issue 48).
EVAL_WHOLE_BYTES = 1 << 30


def _model_copy(outer, client: PSClient, whole, clock: embedding.StepClock, step: int,
                served=()) -> torch.nn.Module:
    """Worker rank 0, for evaluate() (``--eval-every`` and the final one): a CPU copy of the
    model as ``model()`` returns it, at the start of ``step``: the dense parameters and buffers
    from this worker, the tables kept whole pulled now, and the served embeddings (``served``,
    ServedEmbedding items) pulled whole when together they hold at most ``EVAL_WHOLE_BYTES``,
    else still served (``embedding.attach``: each lookup pulls its rows from the servers as of
    ``step``, recording nothing under no_grad; a direct read of such a table's ``.weight``
    sees an empty tensor), so no process holds a large served table whole. Its bytes are not
    counted as a training step's, and it reads no hot-row cache (cache_client.py)."""
    client.cache_off = True
    copy = cpu_copy(outer)
    inner = inner_module(copy)
    params = dict(inner.named_parameters())
    for t, _ in whole:
        params[t.name].data.copy_(client.pull(t, None, step).reshape(params[t.name].shape))
    size = sum(item.table.rows * item.table.dim * item.table.dtype.itemsize for item in served)
    if served and size <= EVAL_WHOLE_BYTES:
        modules = dict(inner.named_modules())
        for item in served:
            name = item.table.name
            module = modules[name[: -len(".weight")] if name.endswith(".weight") else ""]
            module.__dict__.pop("forward", None)   # the class's own forward, over the whole table
            module.weight.data = client.pull(item.table, None, step).reshape(item.table.shape)
    clock.step = step
    return copy


def _done_evaluating(client: PSClient) -> None:
    """Forget the bytes of evaluate()'s pulls (they are not a training step's); training pulls
    read the hot-row caches again."""
    client.cache_off = False
    client.bytes.take()
    client.bytes.take_remote()


def _pull_ahead(cfg, step: int, caches=None) -> bool:
    """Whether step ``step``'s rows may be requested during the step before (PullAhead):
    not past the last step, not for a step after which rank 0 pulls whole tables for
    evaluation (its answers would share the reply tags), not for a step that starts a hot-row
    cache epoch (its pulls follow the epoch's CACHE requests), and not with ``"pull_ahead":
    false`` in the plan (for A/B measurements)."""
    return (step < cfg.steps and not evaluate_now(cfg, step) and (cfg.plan or {}).get("pull_ahead", True)
            and not (caches and caches.boundary(step)))


def train(ctx: WorkerContext) -> TrainResult:
    """Train ``cfg.steps`` synchronous steps with dense parameters on AllReduce (``hybrid``)
    or nothing on AllReduce (``ps``), PS tables on the servers. Returns the whole trained
    model on worker rank 0 and bytes per step per worker (also ``extra["by_param"]``)."""
    cfg, job = ctx.cfg, ctx.job
    outer, model, tables, groups, client, clock, served, whole, dense, opt = _setup(ctx)   # model: the module inside
    ps_names = {t.name for t in tables}
    tools = step_tools(cfg, job, opt, ctx.device)   # the servers replay the same schedule (hybrid/schedule.py)
    caches = client.caches
    ctx.start_step = _resume(ctx, model, opt, tools, ps_names, caches)
    if ctx.rank == 0 and cfg.eval and not cfg.resume and ctx.event is not None:   # the served rows on demand, at step 0
        ctx.event({"kind": "phase", "phase": "evaluate"})   # not a stall (launcher/run/health.py)
        # evaluate()'s own peak is not training's (as workers/worker.py runs the other runtimes' first one)
        with memory.outside_window(), torch.random.fork_rng(devices=[]), activity.doing("in evaluate() before training"):
            ctx.event({"kind": "first_eval", "eval": job.run_evaluate(_model_copy(outer, client, whole, clock, 0, served))})
        _done_evaluating(client)
        ctx.event({"kind": "phase", "phase": "train"})
    local = LocalAggregator(groups.host, list(groups.host_ranks), ctx.rank, client.bytes) if groups.host else None
    net = outer
    if dense:
        net = wrap(outer, groups.workers.dense, ctx.device, cfg.find_unused_parameters, ignore=ps_names)
        ring_remote = ring_successor_remote(ctx, list(range(ctx.world_size)))
        net.register_comm_hook((client.bytes, ctx.world_size, groups.workers.dense, ring_remote), group_allreduce_hook)
    drawn = job.batches(ctx.rank, ctx.world_size, cfg.batch_size)
    # past the batches trained on before the checkpoint (the same data as an uninterrupted run)
    first = [first_batch(lambda i: next(drawn), ctx.start_step * cfg.accumulate)] if ctx.start_step < cfg.steps else []
    if first:
        check_first_batch(ctx, first[0][0], groups.workers.control)   # equal sizes on every worker, before any step
    batches = ahead.PullAhead(served, client, itertools.chain(first, drawn))
    meter, totals, steps_done = StepMeter(ctx, 0), {}, 0
    pending = []   # this step's sends to the servers
    # Under --accumulate A, every micro-step pushes its rows, but only the last one counts its
    # worker(s): the servers sum the pushes and apply the step once every worker's last is in.
    counts = [1]

    copies = []   # (table, HostGradients): gradients on their way to the host, pushed once there
    # fp16: the step's pushes are held until every worker agrees the step is finite (hybrid/fp16.py)
    held = [] if cfg.precision == "fp16" else None
    scaled_opt = (opt or fp16.placeholder_optimizer(ctx.device)) if held is not None else None

    def send(table, grads, count: int) -> None:
        if grads is None:
            return
        if held is not None:
            held.append((table, grads, count))
        else:
            pending.extend(client.push(table, grads[0], grads[1], clock.step, count=count))

    def outgoing(table, grads):   # a cached table's rows to push now (cache.RowCache.outgoing)
        return grads if caches is None else caches.outgoing(table, grads, clock.step)

    def push(item) -> None:   # may run inside backward: never waits for the device
        grads = item.host_gradients()
        if grads is not None:
            copies.append((item.table, grads))
        elif caches is not None:   # no gradient this step, but held ones may be due
            send(item.table, outgoing(item.table, None), counts[0])
        send_copied(wait=False)
        batches.send()   # once this step's last table is pushed: the next step's rows

    def send_copied(wait: bool) -> None:
        while copies and (wait or copies[0][1].ready()):
            table, grads = copies.pop(0)
            send(table, outgoing(table, grads.result()), counts[0])
    # without local aggregation (a collective), tables are pushed from inside backward
    clock.on_gradients = push if local is None and held is None else None
    for step in range(ctx.start_step, cfg.steps):
        meter.start()
        clock.step = step
        if caches is not None:
            pending += caches.begin(step)   # a cache epoch starts: the servers hear its rows first
        for t, p in whole:
            p.data.copy_(to_device(client.pull(t, None, step).reshape(p.shape), p.device))
            p.grad = None
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        step_loss, samples, push_s = 0.0, 0, 0.0
        for micro in range(cfg.accumulate):
            final = micro == cfg.accumulate - 1
            counts[0] = 1 if final else 0
            inputs, targets = next(batches)
            samples += batch_samples(inputs)
            host_inputs = inputs
            inputs, targets = move_to(inputs, ctx.device), move_to(targets, ctx.device)
            clock.set_batch(host_inputs, inputs)     # ids are read on the host, never copied back
            ahead.prefetch(served, client, clock)
            with (contextlib.nullcontext() if final or net is outer else net.no_sync()):
                with tools.autocast(), (unused_error_named(net) if net is not outer else contextlib.nullcontext()):
                    output = call_model(net, inputs)
                    loss = job.compute_loss(output, targets) / cfg.accumulate
                if final and clock.on_gradients is not None and _pull_ahead(cfg, step + 1, caches):
                    batches.plan(step + 1)
                tools.backward(loss)   # scaled under fp16
            step_loss += loss.item()
            t_push = time.perf_counter()
            for item in served:
                if local is not None:
                    send(item.table, local.reduce(item.table, outgoing(item.table, item.gradients())),
                         len(local.ranks) * counts[0])
                elif not item.pushed:
                    push(item)
                item.clear()
            send_copied(wait=True)
            batches.send(force=True)
            push_s += time.perf_counter() - t_push
        meter.samples_per_step = samples
        t_push = time.perf_counter()
        for t, p in whole:
            if p.grad is not None:
                send(t, (None, p.grad.detach().to("cpu").reshape(t.rows, t.dim)), 1)
        skipped = held is not None and fp16.unscale_and_agree(tools.scaler, scaled_opt, [g for _, (_, g), _ in held],
                                                               groups.workers.control)
        for table, (ids, g), count in ([] if skipped else held or []):   # a skipped step pushes nothing
            pending += client.push(table, ids, g, step, count=count)
        if held:
            held.clear()
        if caches is not None:
            caches.end_step(step)
        pending += client.done(step)
        if cfg.clip_grad_norm:   # the global norm spans the servers' rows: see strategies/hybrid/server.py
            _clip_with_servers(ctx, dense)
        lr = tools.lr(opt) if opt is not None else None
        if opt is not None:  # the dense update runs while the pushes are on the wire
            tools.step(opt, lambda: dense, clip=False)
        elif scaled_opt is not None:   # ps under fp16: the scaler's update, on every worker alike
            tools.step(scaled_opt, lambda: [], clip=False)
        for work in pending:
            work.wait()
        pending.clear()
        push_s += time.perf_counter() - t_push
        remote = client.bytes.take_remote()
        by_name = client.bytes.take()     # the PS tables' bytes and, under DENSE, the AllReduce's
        for k, (s, r) in by_name.items():
            acc = totals.setdefault(k, [0.0, 0.0])
            acc[0] += s
            acc[1] += r
        steps_done += 1
        sent = sum(s for s, _ in by_name.values())
        recv = sum(r for _, r in by_name.values())
        logged = job.run_log(step + 1, output, targets) if ctx.rank == 0 else {}
        meter.end(step_loss, sent, recv, extra={"pull_s": client.pull_s, "push_s": push_s,
                                                  **({"lr": lr} if lr is not None else {}),
                                                  **({"skipped_step": 1} if skipped else {})},
                  sent_remote=remote, logged=logged)
        client.pull_s = 0.0
        # the checkpoint first: the servers wait in its commit barrier, where they could not
        # answer the evaluation's pulls of served rows (a deadlock when both fall on a step)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            _save(ctx, step + 1, model, opt, tools, ps_names, caches)
        evaluate_during_training(job, cfg, ctx.rank, step + 1, lambda: _model_copy(outer, client, whole, clock, step + 1, served),
                                 ctx.report_eval)
        _done_evaluating(client)
    eval_last = None
    if ctx.rank == 0:   # while the servers still answer: evaluate() reads served rows on demand
        if ctx.event is not None:
            ctx.event({"kind": "phase", "phase": "evaluate"})   # not a stall (launcher/run/health.py)
        with activity.doing("in evaluate() after the last step"):
            eval_last = job.run_evaluate(_model_copy(outer, client, whole, clock, cfg.steps, served)) if cfg.eval else {}
        _done_evaluating(client)
    client.finish()
    # the dense part where it lives (every worker holds it: DCP writes one copy); the servers write the tables
    on_servers = served_names(model, ps_names)
    run_state.write_final(cfg.run_dir, {k: v for k, v in run_state.model_entries(model).items()
                                        if k[len("model."):] not in on_servers})
    embedding.detach(served)
    # each worker's peak RSS over the run: training, evaluate(), the final write (int64 tensors, not pickles)
    peaks = [p for (p,) in all_gather_ints([build.peak_rss_bytes()], group=groups.workers.control)]
    n = max(steps_done, 1)
    by_param = {k: {"sent": v[0] / n, "recv": v[1] / n} for k, v in sorted(totals.items())}
    losses = mean_over_workers([meter.losses[0], meter.losses[-1]] if meter.losses else [float("nan")] * 2,
                               groups.workers, ctx.world_size)
    result = meter.result(None, replicas=ctx.world_size,
                          extra={"by_param": by_param, "servers": cfg.servers or 1, "worker_peak_rss_bytes": peaks,
                                 "ps_params": sorted(ps_names), "pulls_ahead": batches.sent,
                                 **({"cache": caches.summary(((cfg.plan or {}).get("cache") or {}).get(
                                     "predicted_hit_rate"))} if caches else {})})
    result.loss_first, result.loss_last = losses
    result.eval_last = eval_last
    return result
