"""The shape of a strategy's spec (:class:`StrategySpec`), and the placement values the hybrid
family's plans use: a parameter lives on the parameter servers (``ON_SERVERS``) or is averaged
with AllReduce (``ON_ALLREDUCE``)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

ON_SERVERS = "ps"  # a plan's placement value: sharded on the parameter servers
ON_ALLREDUCE = "allreduce"  # a plan's placement value: replicated, gradients AllReduced


@dataclass(frozen=True)
class StrategySpec:
    """One training strategy as the rest of hpar sees it.

    ``runtime``, ``estimate``, ``worker_memory`` and ``check_available`` are
    ``"module:function"`` references (:meth:`load`): the worker's ``train(ctx) ->
    TrainResult``; the cost model's ``(Profile, ClusterSpec) -> Estimate`` (None: the planner
    does not predict it); the memory model's worker terms ``(Profile, ClusterSpec, Estimate,
    schedule) -> {term: bytes}``; a check ``() -> None`` that raises ValueError (one line)
    where this torch build lacks what the runtime needs ("": nothing to check);
    ``check_model`` a check ``(job, model, lr) -> str`` of the user's model and optimizer
    before start: raises ValueError (one line) for what the runtime cannot run, returns a
    line to print ("" for none).
    ``evaluate_memory``: ``"module:function"`` of worker 0's terms ``(Profile, ClusterSpec,
    Estimate) -> {term: bytes}`` after the last step, where ``evaluate()`` needs a whole copy
    of a model no worker holds whole (strategies/plan/memory_sharded.py; "": none).
    ``profile_probe``: the runtime's own seconds per step on the profiled model, measured by
    the profiler through it (``(job, device, cast, timed, model_bytes) -> float | None``; FSDP2's
    shard and hooks); ``cluster_probe``: a measurement of the runtime on this machine the
    cluster description records (``() -> float``: a parameter-server request's CPU seconds).
    Both let the earlier stages measure a runtime without importing it ("": none).
    ``unused_by_rank``: it trains a model whose ranks' batches leave different parameters
    without a gradient in one step (a mixture of experts; strategies/profile/unused.py).
    ``check(cfg) -> str | None`` says, in one line naming the flag and the way out, why a run
    config asks for something this strategy cannot honour (None: it can).

    Properties the rest of hpar asks instead of comparing names:
    ``servers``: parameter servers run beside the workers (``--servers``, ``--server-memory``,
    ``--staleness``; its runtime evaluates before training itself, reading served rows);
    ``ddp``: its workers run DDP (``--find-unused-parameters``); ``pipelined``: workers are
    stages of K x R pipelines, not data-parallel replicas (stages, micro-batches,
    ``--pipeline-replicas``, schedules); ``needs_plan``: ``--strategy NAME`` still profiles to
    plan it (a pipeline's balanced stages); ``sparse_gradients``: embedding tables get sparse
    gradients; ``simplicity``: lower is simpler (planner near-ties); ``runs_as``: a planner
    candidate that runs as that strategy (``hybrid-cache`` runs ``hybrid``); ``plain``: the
    strategy this one runs as when the model gives it nothing to do (no table to serve or to
    give sparse gradients): "" for none; ``compress_hooks``: its dense gradients are averaged
    by DDP's AllReduce, whose communication hook ``--compress`` replaces
    (strategies/runtimes/dataparallel/compress_hooks.py); ``sync_batchnorm``: its workers are
    data-parallel replicas whose BatchNorm layers can normalise over every worker's batch
    (``--sync-batchnorm``, strategies/runtimes/dataparallel/sync_batchnorm.py).
    """

    name: str
    summary: str
    runtime: str
    estimate: str | None
    worker_memory: str | None
    simplicity: int
    servers: bool = False
    ddp: bool = False
    pipelined: bool = False
    needs_plan: bool = False
    sparse_gradients: bool = False
    compress_hooks: bool = False
    runs_as: str = ""
    plain: str = ""
    sync_batchnorm: bool = False
    check: Callable[[Any], str | None] | None = None
    check_available: str = ""
    check_model: str = ""
    unused_by_rank: bool = True
    evaluate_memory: str = ""
    profile_probe: str = ""
    cluster_probe: str = ""

    def load(self, what: str) -> Callable:
        """The function ``what`` (``"runtime"``, ``"estimate"``, ``"worker_memory"``,
        ``"evaluate_memory"``, ``"check_available"``, ``"check_model"``, ``"profile_probe"`` or
        ``"cluster_probe"``) names,
        imported now. Raises ValueError when the spec names none."""
        ref = getattr(self, what)
        if not ref:
            raise ValueError(f"strategy {self.name} has no {what}")
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)

    def problem(self, cfg) -> str | None:
        """``check(cfg)``: why this strategy cannot run ``cfg`` as given (one line), or None."""
        return self.check(cfg) if self.check is not None else None
