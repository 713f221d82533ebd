"""The ``torchrec`` runtime: TorchRec's DistributedModelParallel in the training spine.

Every worker builds the user's model with the run's seed (the same initial tables everywhere),
swaps its tables for one-table TorchRec collections (trec_tables.py), shards them with the
script's optimizer fused into their backward and the rest in DDP (trec_shard.py), and copies
the user's initial rows into its shards. A step is one forward and backward of the worker's
batch (the tables' rows are updated inside the backward, averaged over the workers as DDP
averages the dense gradients) and the script's optimizer on the dense parameters: N workers
equal one process on the concatenated batch where the fused update is the dense one
(trec_optim.py). Evaluation and the trained model gather every table whole (a collective) and
load it, with the dense parameters, into a fresh copy of the user's model.

Bytes per step: DDP's AllReduce of the dense parameters (and of data-parallel tables) from a
communication hook, as ``allreduce`` counts it; the all-to-all of a sharded table estimated
from the ids and bags its lookups took this step: the ids (8 bytes each) and bag lengths (8
bytes) go to the shards' owners, the pooled rows (4 bytes x dim per bag) come back and their
gradients return, each a fraction (N-1)/N leaving the worker; a row-wise table's pooled rows
are partial sums from every worker (a reduce-scatter of N times the worker's bags, which on
gloo moves an AllReduce's bytes, twice: costmodel_torchrec.GLOO_REDUCE_SCATTER); a
column-wise table's ids go to each of its column shards' owners (as many as TorchRec cut:
torchrec_spec.column_shards).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hpar.strategies.runtimes import spine
from hpar.strategies.job.context import DENSE, ByteMeter, StepMeter, TrainResult, WorkerContext, ring_successor_remote
from hpar.strategies.common.groups import worker_groups
from hpar.strategies.job.loop import micro_steps, step_tools, worker_batches
from hpar.strategies.runtimes.spine import StepOutcome, TrainStep
from hpar.strategies.job.forward import inner_module, takes_keywords
from hpar.strategies.plan.costmodel_torchrec import GLOO_REDUCE_SCATTER
from hpar.strategies.state import state as run_state
from hpar.strategies.specs.torchrec_spec import SHARDINGS
from hpar.strategies.runtimes.torchrec import trec_state
from hpar.strategies.runtimes.torchrec.trec_check import import_torchrec
from hpar.strategies.runtimes.torchrec.trec_optim import fused_optimizer
from hpar.strategies.runtimes.torchrec.trec_shard import (
    gather_tables,
    load_tables,
    quiet,
    shard,
    table_key,
    table_modules,
)
from hpar.strategies.runtimes.torchrec.trec_tables import swap_tables, tables_of

A2A = "all_to_all"

try:  # torchrec and FBGEMM (~44 MB resident) land in the worker's memory baseline, as code, not
    import_torchrec()  # training state: workers/worker.py imports this module before the baseline
except ValueError:
    pass  # said in one line by TorchrecStep, as a JobError


class UserCall(nn.Module):
    """Calls the sharded model as hpar calls the user's (``model(**inputs)`` for a dict of its
    forward's names, strategies/job/forward.py), deciding by the user's forward, which
    DistributedModelParallel's ``forward(*args, **kwargs)`` hides."""

    def __init__(self, dmp: nn.Module, user: nn.Module):
        super().__init__()
        self.dmp = dmp
        object.__setattr__(self, "_probe", user)  # not a submodule: the user's model is inside dmp already

    def forward(self, inputs):
        return self.dmp(**inputs) if takes_keywords(self._probe, inputs) else self.dmp(inputs)


class TorchrecStep(TrainStep):
    """One optimizer step of ``torchrec`` for the training spine (strategies/runtimes/spine.py):
    forward and backward through DistributedModelParallel (the tables updated in the
    backward), then unscale-free step and schedule of the script's optimizer on the dense
    parameters (strategies/job/loop.py); bytes from DDP's hook plus the all-to-all
    estimate of the module docstring."""

    def __init__(self, ctx: WorkerContext):
        super().__init__(ctx)
        try:
            import_torchrec()
        except ValueError as exc:
            from hpar.strategies.job.contract import JobError

            raise JobError(str(exc)) from None
        cfg, job = ctx.cfg, ctx.job
        torch.manual_seed(cfg.seed)
        self.model = inner_module(job.build_model())
        named = dict(self.model.named_parameters())
        weights = [f"{n}.weight" for n, _ in tables_of(self.model)]
        kind, self.options, _ = fused_optimizer(
            job.build_optimizer(self.model.parameters(), cfg.lr), [named[w] for w in weights]
        )
        self.fused = kind
        self.initial = {w: named[w].detach().clone() for w in weights}
        self.tables = swap_tables(self.model)
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                if t.device.type != "meta":
                    t.data = t.data.to(ctx.device)

    def resume(self) -> int:
        """Shard the model (every worker: a collective), then load the latest checkpoint
        when ``--resume`` asks for it (trec_state.py)."""
        self._shard()
        return trec_state.resume(self)

    def save(self, steps_done: int) -> None:
        trec_state.save(self, steps_done)

    def _shard(self) -> None:
        ctx, cfg = self.ctx, self.cfg
        self.loss_groups = groups = worker_groups(ctx.world_size, cfg.device)
        quiet()
        self.dmp = shard(
            self.model,
            (self.fused, self.options),
            SHARDINGS.get(cfg.strategy),
            groups,
            ctx.device,
            bool(cfg.find_unused_parameters),
        )
        load_tables(self.dmp, self.tables, self.initial)
        del self.initial
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        self.dense_named = list(in_backward_optimizer_filter(self.dmp.named_parameters()))
        self.dense = [p for _, p in self.dense_named]
        self.opt = self.job.build_optimizer(self.dense, cfg.lr)
        self.tools = step_tools(cfg, self.job, self.opt, ctx.device)
        self.counter = ByteMeter()
        ddp = getattr(self.dmp, "_dmp_wrapped_module", None)
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            from hpar.strategies.runtimes.dataparallel.allreduce import counting_allreduce_hook

            remote = ring_successor_remote(ctx, list(range(ctx.world_size)))
            ddp.register_comm_hook((self.counter, ctx.world_size, groups.dense, remote), counting_allreduce_hook)
        kinds = {t.key: self._sharding(t) for t in self.tables}
        self.row_wise = {k for k, kind in kinds.items() if kind == "row_wise"}
        self.column_shards = {  # a column-wise table's shards (one where TorchRec kept it whole)
            t.key: len(self._parameter_sharding(t).ranks or [0]) for t in self.tables if kinds[t.key] == "column_wise"
        }
        self.scatter = GLOO_REDUCE_SCATTER if dist.get_backend(groups.dense) == "gloo" else 1.0
        if ctx.rank == 0:
            cut = {k: f" x{v}" for k, v in self.column_shards.items()}  # a column-wise table's shard count
            print(
                "torchrec shards " + ", ".join(f"{t.module} {kinds[t.key]}{cut.get(t.key, '')}" for t in self.tables),
                flush=True,
            )
        self.call = UserCall(self.dmp, self.model)

    def begin(self) -> None:
        self.batches = worker_batches(self.ctx, self.loss_groups.control)

    def _parameter_sharding(self, table):
        return self.dmp.plan.plan[f"{table.module}.collection"][table.key]

    def _sharding(self, table) -> str:
        return str(self._parameter_sharding(table).sharding_type)

    def all_to_all_bytes(self) -> float:
        """This step's estimated all-to-all bytes sent by this worker (module docstring)."""
        n, total = self.ctx.world_size, 0.0
        for m in table_modules(self.model):
            ids, bags = m.traffic
            m.traffic[0] = m.traffic[1] = 0
            pooled = bags * m.table.dim * 4 * (n if m.table.key in self.row_wise else 1)
            spread = self.column_shards.get(m.table.key, 1)  # every column shard needs every id
            scatter = self.scatter if m.table.key in self.row_wise else 1.0
            total += ((ids * 8 + bags * 8) * spread + (1 + scatter) * pooled) * (n - 1) / n
        return total

    def step(self, step: int) -> StepOutcome:
        self.opt.zero_grad(set_to_none=True)
        loss, logged, samples = micro_steps(self.ctx, self.call, self.batches, self.tools, step)
        self.samples_per_step = self.samples_per_step or samples
        lr = self.tools.lr(self.opt)
        stepped = self.tools.step(self.opt, lambda: self.dense)
        a2a = self.all_to_all_bytes()
        remote, (sent, recv) = self.counter.take_remote(), self.counter.take().get(DENSE, (0, 0))
        return StepOutcome(
            loss,
            sent + a2a,
            recv + a2a,
            sent_remote=remote,
            logged=logged,
            lr=lr,
            stepped=stepped,
            samples=self.samples_per_step,
            extra={"bytes_all_to_all": a2a},
        )

    def user_model(self) -> nn.Module:
        """The user's model on the CPU with the trained parameters: a collective (every
        worker gathers every table, trec_shard.gather_tables)."""
        tables = gather_tables(self.dmp, self.tables, self.loss_groups.control)
        keys = {table_key(t) for t in self.tables}
        state = {k: v.detach().cpu() for k, v in self.dmp.state_dict().items() if k not in keys}
        torch.manual_seed(self.cfg.seed)
        user = inner_module(self.job.build_model())
        user.load_state_dict({**state, **tables})
        return user

    def evaluate(self, steps_done: int) -> None:
        from hpar.strategies.job.loop import evaluate_during_training

        user = self.user_model()
        evaluate_during_training(self.job, self.cfg, self.ctx.rank, steps_done, lambda: user, self.ctx.report_eval)

    def write_final(self) -> None:
        self.final = self.user_model()
        run_state.write_final(self.cfg.run_dir, run_state.model_entries(self.final))

    def result(self, meter: StepMeter) -> TrainResult:
        return meter.result(self.final if self.ctx.rank == 0 else None, replicas=self.ctx.world_size)


def train(ctx: WorkerContext) -> TrainResult:
    """Train ``ctx.cfg.steps`` steps with TorchRec's sharded tables (:class:`TorchrecStep` in
    the training spine); each worker draws its own batches from ``data(rank, world_size,
    batch_size)``."""
    return spine.train(ctx, TorchrecStep(ctx))
