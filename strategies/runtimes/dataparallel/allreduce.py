"""Synchronous data parallelism with PyTorch DDP: the ``allreduce`` strategy and the
``allreduce-sparse`` peer.

``allreduce``: every gradient dense, averaged with DDP's bucketed AllReduce overlapped with
backward (what Horovod does with ``sparse_as_dense``). Embedding layers are switched to dense
gradients. ``allreduce-sparse``: embedding layers produce sparse gradients, which DDP on gloo
exchanges with AllGather (what Horovod does by default for ``IndexedSlices``); on NCCL, which
has no sparse AllReduce, with the padded AllGather of ``strategies/runtimes/dataparallel/sparse_allgather.py``.
A table whose optimizer has no sparse kernel (Adam, AdamW, RMSprop, ...) is exchanged so too
and its gradient made dense right before the step (``strategies/job/optimizer_rules.py``).
Gradients go over the workers' dense group (NCCL on CUDA), the final losses over the gloo
control group (``strategies/common/groups.py``).

Bytes are counted with a DDP communication hook: a ring AllReduce of a B-byte bucket sends
and receives 2(N-1)/N * B bytes per worker (Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 2009). A sparse gradient (its own bucket) is
exchanged by gloo's sparse AllReduce, an AllGather: this worker's coalesced (indices, values)
go to the N-1 peers and theirs come back.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.strategies.state import checkpoint
from hpar.strategies.state import state as run_state
from hpar.strategies.runtimes.dataparallel.ddp import unused_error_named, wrap
from hpar.strategies.runtimes.dataparallel.compress_hooks import Compressor
from hpar.strategies.common.devices import cpu_copy
from hpar.strategies.common.groups import worker_groups
from hpar.strategies.runtimes.dataparallel.sparse_allgather import padded_allgather_hook, sparse_exchange
from hpar.strategies.job.optimizer_rules import dense_before_step, densify
from hpar.strategies.runtimes.dataparallel import sync_batchnorm
from hpar.strategies.job.tying import embedding_tables
from hpar.strategies.job.context import (
    DENSE,
    ByteMeter,
    StepMeter,
    TrainResult,
    WorkerContext,
    ring_allreduce_bytes,
    ring_successor_remote,
)
from hpar.strategies.job.forward import inner_module
from hpar.strategies.runtimes import spine
from hpar.strategies.job.loop import StepTools, micro_steps, step_tools, worker_batches
from hpar.strategies.runtimes.spine import StepOutcome, TrainStep


def counting_allreduce_hook(state, bucket):
    """DDP communication hook: mean AllReduce of the bucket, counting this worker's bytes.

    ``state`` is (ByteMeter, world size, the workers' dense group, whether the ring successor
    is on another host);
    ``bucket`` a dist.GradBucket (left unannotated: DDP rejects string annotations, which
    this module's postponed evaluation would make).
    A dense bucket costs ring AllReduce bytes; a sparse one (an embedding with sparse=True)
    is exchanged by gloo as an AllGather of (indices, values): see :func:`sparse_allgather_bytes`,
    and divided out of place (torch's default hook divides in place, which corrupts the
    gradients of a layer whose output is added to an embedding's).
    """
    counter, world_size, group, remote = state
    buf = bucket.buffer()
    if buf.is_sparse:
        nbytes = sparse_allgather_bytes(buf, world_size)
    else:
        nbytes = ring_allreduce_bytes(buf.numel() * buf.element_size(), world_size)
    counter.add(DENSE, sent=nbytes, recv=nbytes, remote=remote)
    # a sparse gradient's values can be a view of the gradient flowing into another branch
    # (an embedding's output added to a layer's): divided in place, that branch's gradients shrink
    buf = buf / world_size if buf.is_sparse else buf.div_(world_size)
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def set_sparse_gradients(model: torch.nn.Module, sparse: bool) -> list[str]:
    """Set ``sparse=`` on every nn.Embedding/nn.EmbeddingBag whose weight is row-sparse
    (``tying.embedding_tables``: a weight tied to a dense user, such as a tied output
    projection, keeps dense gradients); returns the names of those weights."""
    tables = {id(m) for _, m in embedding_tables(model)}
    names = []
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            module.sparse = sparse and id(module) in tables
            if id(module) in tables:
                names.append(f"{name}.weight" if name else "weight")
    return names


def sparse_allgather_bytes(grad: torch.Tensor, world_size: int) -> float:
    """Bytes one worker sends in an AllGather of a sparse gradient: its (indices, values)
    after coalescing, to each of the N-1 peers; it receives about as much from them."""
    g = grad.coalesce()
    own = g.indices().numel() * g.indices().element_size() + g.values().numel() * g.values().element_size()
    return float(own * (world_size - 1))


@contextlib.contextmanager
def _sync(ddp, last: bool, event=None):
    """Around one micro-step: DDP's ``no_sync`` on all but the last of a step, and its
    unused-parameter error in one line, told to ``event`` first (strategies/runtimes/dataparallel/ddp.py)."""
    with contextlib.nullcontext() if last else ddp.no_sync(), unused_error_named(ddp, event):
        yield


def save_state(
    ctx: WorkerContext,
    step: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    tools: StepTools | None = None,
    extra: dict | None = None,
) -> None:
    """Checkpoint ``step`` (a collective over the default group): this worker writes the state
    it holds, its model (DDP's replicas: one copy is kept; FSDP's DTensor shards: each rank its
    own), optimizer state by parameter name, loop state and random generators, with
    torch.distributed.checkpoint (strategies/state/state.py); nothing is gathered. ``extra``:
    more of this worker's entries (``--compress powersgd``'s state)."""
    run_state.save(
        ctx.cfg.run_dir,
        step,
        {**run_state.process_entries(model, opt, tools, ctx.device, f"worker{ctx.rank}", "workers"), **(extra or {})},
        keep=ctx.cfg.keep_checkpoints,
    )


def resume_state(
    ctx: WorkerContext, model: torch.nn.Module, opt: torch.optim.Optimizer, tools: StepTools | None = None
) -> int:
    """Load this worker's state from the run's latest checkpoint when it resumes (model,
    optimizer by parameter name, loop state, random generators: strategies/state/state.py; any
    checkpoint of the run, whatever its number of workers, DTensor shards of fsdp included);
    returns the step to start from."""
    step = checkpoint.latest_step(ctx.cfg.run_dir) if ctx.cfg.resume else None
    if step is None:
        return 0
    run_state.restore_process(ctx.cfg.run_dir, step, model, opt, tools, ctx.device, f"worker{ctx.rank}", "workers")
    return step


class AllreduceStep(TrainStep):
    """One DDP optimizer step of ``allreduce``/``allreduce-sparse`` for the training spine
    (strategies/runtimes/spine.py): ``--accumulate`` micro-steps (DDP's ``no_sync`` on all but
    the last), sparse tables made dense where their optimizer needs it, then unscale, clip,
    step and schedule (strategies/job/loop.py). Bytes come from the DDP communication hook.

    DDP wraps the model as ``model()`` returned it (``outer``: a ``torch.compile`` wrapper runs
    the forward compiled; DDP's hooks and AllReduce run outside it, on the gradients), while
    the embeddings' ``sparse=`` flags and checkpoints go to the module the user wrote
    (``model``, :func:`inner_module`), so a compiled run's state carries the user's names."""

    def __init__(self, ctx: WorkerContext):
        super().__init__(ctx)
        cfg, job = ctx.cfg, ctx.job
        torch.manual_seed(cfg.seed)
        self.outer = job.build_model().to(ctx.device)
        self.model = inner_module(self.outer)
        self.sparse = strategy_spec(cfg.strategy).sparse_gradients
        tables = set_sparse_gradients(self.model, self.sparse)
        if self.sparse:  # torch's sparse optimizers warn every worker unless the checks are chosen explicitly
            torch.sparse.check_sparse_tensor_invariants.disable()
        self.opt = job.build_optimizer(self.model.parameters(), cfg.lr)
        named = dict(self.model.named_parameters(remove_duplicate=False))
        # a table whose optimizer has no sparse kernel (Adam, AdamW, ...): exchanged sparse, made dense to step
        self.to_dense = (
            [p for _, p in dense_before_step(self.opt, [(n, named[n]) for n in tables])] if self.sparse else []
        )
        self.tools = step_tools(cfg, job, self.opt, ctx.device)
        self.compressor = Compressor(
            cfg.compress, cfg.steps, ctx.rank
        )  # --compress (strategies/runtimes/dataparallel/compress_hooks.py)

    def resume(self) -> int:
        step = resume_state(self.ctx, self.model, self.opt, self.tools)
        if step:
            self.compressor.restore(checkpoint.step_dir(self.cfg.run_dir, step))
        return step

    def begin(self) -> None:
        ctx, cfg = self.ctx, self.cfg
        self.counter = ByteMeter()
        self.loss_groups = groups = worker_groups(ctx.world_size, cfg.device)
        if cfg.sync_batchnorm:  # --sync-batchnorm: before DDP wraps the model
            sync_batchnorm.convert(self.model, groups.dense, ctx.device)
        self.ddp = wrap(
            self.outer, groups.dense, ctx.device, cfg.find_unused_parameters
        )  # strategies/runtimes/dataparallel/ddp.py
        ring_remote = ring_successor_remote(ctx, list(range(ctx.world_size)))
        padded = self.sparse and sparse_exchange(cfg.plan, groups.backend) == "allgather-padded"
        self.compressor.attach(
            self.ddp,
            (self.counter, ctx.world_size, groups.dense, ring_remote),
            padded_allgather_hook if padded else counting_allreduce_hook,
        )
        self.batches = worker_batches(ctx, groups.control)  # the first batch's size checked against the peers'

    def step(self, step: int) -> StepOutcome:
        self.opt.zero_grad(set_to_none=True)
        loss, logged, samples = micro_steps(
            self.ctx, self.ddp, self.batches, self.tools, step, lambda last: _sync(self.ddp, last, self.ctx.event)
        )
        self.samples_per_step = self.samples_per_step or samples  # the first step's batches, as measured
        lr = self.tools.lr(self.opt)
        densify(self.to_dense)
        stepped = self.tools.step(self.opt, lambda: list(self.model.parameters()))
        remote, (sent, recv) = self.counter.take_remote(), self.counter.take().get(DENSE, (0, 0))
        return StepOutcome(
            loss, sent, recv, sent_remote=remote, logged=logged, lr=lr, stepped=stepped, samples=self.samples_per_step
        )

    def save(self, steps_done: int) -> None:
        save_state(self.ctx, steps_done, self.model, self.opt, self.tools, self.compressor.entries())

    def model_copy(self, steps_done: int) -> torch.nn.Module:
        with sync_batchnorm.plain_batchnorm(self.model):  # worker 0 evaluates it alone
            return cpu_copy(self.outer)

    def write_final(self) -> None:
        run_state.write_final(self.cfg.run_dir, run_state.model_entries(self.model))  # replicas: DCP writes one copy

    def result(self, meter: StepMeter) -> TrainResult:
        sync_batchnorm.to_plain(self.model)  # the model worker 0 evaluates alone
        result = meter.result(self.outer if self.ctx.rank == 0 else None, replicas=self.ctx.world_size)
        set_sparse_gradients(self.model, False)
        return result


def train(ctx: WorkerContext) -> TrainResult:
    """Train ``ctx.cfg.steps`` optimizer steps with DDP (:class:`AllreduceStep` in the training
    spine). Each worker draws its own batches from ``data(rank, world_size, batch_size)``,
    ``--accumulate`` of them per step; gradients are averaged, so N workers equal one process
    on the concatenated N x accumulate batches with a mean loss, also with the script's
    schedule, ``--clip-grad-norm`` and ``--precision`` (strategies/job/loop.py)."""
    return spine.train(ctx, AllreduceStep(ctx))
