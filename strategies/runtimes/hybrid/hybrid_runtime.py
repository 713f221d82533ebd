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
Round trips are cut by pulls ahead (ahead.py), pushes from inside backward, asynchronous pushes
and DONE overlapping the dense optimizer step, and per-host aggregation of sparse gradients
before they cross hosts (ps_client.LocalAggregator); hot rows may be cached on the workers
(``--staleness s``: HET, VLDB 2022, strategies/runtimes/hybrid/cache.py).

Invariant: sparse gradients are *averaged* over workers on the server (sum of pushes / N), as
DDP averages the dense ones, so N workers with a mean loss each match one process on the
concatenated batch with a mean loss (equal per-worker batch sizes). Checkpoints: the part
``worker0`` holds the dense parameters, the worker optimizer state and every worker's RNG
state; ``server{i}`` parts hold the shards and their optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hpar.strategies.runtimes import spine
from hpar.strategies.job.context import TrainResult, WorkerContext
from hpar.strategies.common.groups import WorkerGroups, worker_groups
from hpar.strategies.runtimes.dataparallel.allreduce import set_sparse_gradients
from hpar.strategies.runtimes.hybrid import build, embedding
from hpar.strategies.specs.servers_spec import REFRESH_STEPS, CacheConfig
from hpar.strategies.runtimes.hybrid.cache_client import WorkerCaches
from hpar.strategies.runtimes.hybrid.client import PSClient, ps_tables
from hpar.strategies.runtimes.hybrid.worker_parts import WorkerParts
from hpar.strategies.runtimes.hybrid.worker_step import HybridStep
from hpar.strategies.job.forward import inner_module
from hpar.strategies.specs.decision import Plan


@dataclass(frozen=True)
class Groups:
    """Process groups every process of a hybrid/ps run creates, in the same order:
    ``workers`` (the workers' dense and control groups, strategies/common/groups.py: the dense
    AllReduce on NCCL when CUDA, CPU values on gloo) and, where local aggregation is on,
    one gloo group per host with several workers; ``host``/``host_ranks`` are this process's."""

    workers: WorkerGroups
    host: object = None
    host_ranks: tuple[int, ...] = ()


def make_groups(num_workers: int, device_type: str, hosts: tuple[int, ...], plan: Plan) -> Groups:
    """Create the run's subgroups: a collective over the default group, so servers call it
    too, with the same arguments (``hosts``: the host index of every default-group rank,
    from ``workers.worker.init_group``). Local aggregation is on for a host with several
    workers when a server lives on another host (its pushes then cross the network), or as
    ``plan.local_aggregation`` (True/False; None: decided so) says."""
    workers = worker_groups(num_workers, device_type)
    worker_hosts, server_hosts = hosts[:num_workers], hosts[num_workers:]
    want = plan.local_aggregation
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


def _setup(ctx: WorkerContext) -> WorkerParts:
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
    if cfg.staleness is not None:  # the hot-row caches (client.caches)
        planned = cfg.plan.cache or {}
        WorkerCaches(
            CacheConfig(cfg.cache_rows, cfg.staleness),
            tables,
            client,
            ctx.rank,
            cfg.steps,
            cfg.checkpoint_every,
            planned.get("hot_rows"),
            planned.get("refresh_steps", REFRESH_STEPS),
        )
    clock = embedding.StepClock()
    served = embedding.attach(model, [t for t in tables if t.kind == "rows"], client, clock)
    if on_meta:
        build.to_empty_keeping_ties(model, ctx.device)  # storage for the dense part only: the tables are empty
    else:
        model.to(ctx.device)
    build.broadcast_dense(model, {t.name for t in tables}, src=ctx.world_size)  # from server 0
    params = dict(model.named_parameters())
    whole = [(t, params[t.name]) for t in tables if t.kind == "whole"]
    ps_names = {t.name for t in tables}
    # the trainable parameters the workers hold: DDP and the workers' optimizer; a frozen one
    # (kept on the workers, plan/placement.py) is neither averaged nor stepped
    dense = [p for n, p in model.named_parameters() if n not in ps_names and p.requires_grad]
    opt = job.build_optimizer(dense, cfg.lr) if dense else None
    return WorkerParts(outer, model, tables, groups, client, clock, served, whole, dense, opt)


def train(ctx: WorkerContext) -> TrainResult:
    """Train ``cfg.steps`` synchronous steps with dense parameters on AllReduce (``hybrid``)
    or nothing on AllReduce (``ps``), PS tables on the servers (the training spine with
    strategies/runtimes/hybrid/worker_step.HybridStep). Returns the whole trained model on worker rank 0
    and bytes per step per worker (also ``extra["by_param"]``)."""
    return spine.train(ctx, HybridStep(ctx, _setup(ctx)))
