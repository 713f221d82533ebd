"""The ``fsdp`` strategy: torch's fully sharded data parallelism (FSDP2,
``torch.distributed.fsdp.fully_shard``), the peer of choice for a dense model whose replica,
gradients and optimizer state do not fit one device (Zhao et al., "PyTorch FSDP", VLDB 2023;
ZeRO stage 3, Rajbhandari et al., SC 2020).

Units: every layer of the model (strategies/job/layers.py), or for another model its repeated
blocks (``traced.block_names``), each ``fully_shard``-ed, then the root, which keeps what no unit
holds (embeddings, a head, a tied weight: FSDP manages a parameter in one unit only). The mesh is
the workers' dense group (``DeviceMesh.from_group``; NCCL on CUDA). The training loop is
allreduce's (strategies/job/loop.py; fp16 refused, its scaler's inf check would need a reduction
over the shards); checkpoints are each rank's shards through strategies/state/state.py, and only
``evaluate()`` and ``save_pretrained`` get a whole model, gathered to rank 0's host memory.

Invariants: every worker builds the whole model with the run's seed before sharding (FSDP2 does
not broadcast the initial weights, pytorch#148756), and every unit reduces its gradients as a
SUM divided by N (``set_force_sum_reduction_for_comms``, ``set_gradient_divide_factor``: on gloo
FSDP2's AVG once summed, pytorch#162338), so N workers equal one process on the concatenated
batch on any backend. Bytes per step: two AllGathers of every unit and a reduce-scatter of every
gradient (strategies/plan/costmodel_fsdp.fsdp_bytes). The user's view: docs/strategies.md, "fsdp".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp_state  # at import: before a worker's memory baseline
from torch import nn

try:  # FSDP2's public API since torch 2.6
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # pragma: no cover - torch < 2.6
    FSDPModule = fully_shard = DeviceMesh = None

from hpar.strategies.state import state as run_state
from hpar.strategies.runtimes.dataparallel.allreduce import resume_state, ring_successor_remote, save_state
from hpar.strategies.job.context import StepMeter, TrainResult, WorkerContext
from hpar.strategies.job.forward import inner_module
from hpar.strategies.common.groups import worker_groups
from hpar.strategies.job.layers import is_declared_sequence, model_layers
from hpar.strategies.runtimes import spine
from hpar.strategies.job.loop import evaluate_during_training, micro_steps, step_tools, worker_batches
from hpar.strategies.runtimes.spine import StepOutcome, TrainStep
from hpar.strategies.plan.costmodel_fsdp import fsdp_bytes


def units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` wraps one by one (module docstring): layers with parameters,
    none holding a parameter another unit holds too."""
    if is_declared_sequence(model):
        candidates = [m for _, m in model_layers(model)]
    else:
        from hpar.strategies.job.traced import block_names

        candidates = [model.get_submodule(n) for n in block_names(model)]
    candidates = [m for m in candidates if any(True for _ in m.parameters())]
    owners: dict[int, int] = {}
    for m in candidates:
        for p in m.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [m for m in candidates if all(owners[id(p)] == 1 for p in m.parameters())]


def shard(model: nn.Module, group, device: torch.device, world_size: int) -> list[nn.Module]:
    """``fully_shard`` every unit of ``model`` and then ``model`` over ``group`` (the workers'
    dense group) on ``device``'s type, each reducing gradients as a sum divided by
    ``world_size`` (module docstring); returns the units. Raises ValueError where this torch
    has no FSDP2 (:func:`check_available`)."""
    check_available()
    mesh = DeviceMesh.from_group(group, device.type)
    wrapped = units(model)
    for unit in wrapped:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # pytorch#162338: no AVG on the backend
            m.set_gradient_divide_factor(float(world_size))
    return wrapped


def check_available() -> None:
    """Raise ValueError (one line) where this torch lacks FSDP2 or the reduction settings
    hpar's exactness on gloo relies on (``set_force_sum_reduction_for_comms``)."""
    if fully_shard is None or not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        raise ValueError(
            f"--strategy fsdp needs torch.distributed.fsdp.fully_shard with FSDPModule."
            f"set_force_sum_reduction_for_comms (torch 2.13 has them); torch {torch.__version__} lacks them"
        )


def full_state(model: nn.Module) -> dict:
    """Collective over the workers: the whole model's state dict, on the CPU, on rank 0 (empty
    elsewhere)."""
    return dcp_state.get_model_state_dict(
        model, options=dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def cpu_model(ctx: WorkerContext, state: dict) -> nn.Module:
    """A freshly built model (``model()`` as the user returns it) with ``state`` loaded, on the CPU."""
    fresh = ctx.job.build_model()
    inner_module(fresh).load_state_dict(state)
    return fresh


class FsdpStep(TrainStep):
    """One FSDP2 optimizer step for the training spine (strategies/runtimes/spine.py): the
    ``--accumulate`` micro-steps on the sharded model (every one reduce-scatters), clipping by
    the global norm over the shards, the step and the schedule (module docstring). Checkpoints:
    each rank its shards; ``evaluate()``: every worker gathers, rank 0 evaluates a CPU copy."""

    def __init__(self, ctx: WorkerContext):
        super().__init__(ctx)
        cfg, job = ctx.cfg, ctx.job
        torch.manual_seed(cfg.seed)
        self.model = inner_module(job.build_model())
        self.loss_groups = worker_groups(ctx.world_size, cfg.device)
        if (
            cfg.sync_batchnorm
        ):  # --sync-batchnorm: before fully_shard (strategies/runtimes/dataparallel/sync_batchnorm.py)
            from hpar.strategies.runtimes.dataparallel.sync_batchnorm import convert

            convert(self.model, self.loss_groups.dense, ctx.device)
        self.wrapped = shard(self.model, self.loss_groups.dense, ctx.device, ctx.world_size)
        self.opt = job.build_optimizer(self.model.parameters(), cfg.lr)  # over the shards (DTensors)
        self.tools = step_tools(cfg, job, self.opt, ctx.device)

    def resume(self) -> int:
        return resume_state(self.ctx, self.model, self.opt, self.tools)  # each rank its shards: DCP reshards them

    def begin(self) -> None:
        ctx = self.ctx
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())  # the whole model's bytes
        trained = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)  # reduced
        self.sent = fsdp_bytes(total, ctx.world_size, self.cfg.backend == "gloo", trained) * self.cfg.accumulate
        self.remote = self.sent if ring_successor_remote(ctx, list(range(ctx.world_size))) else 0.0
        self.batches = worker_batches(
            ctx, self.loss_groups.control
        )  # the first batch's size checked against the peers'

    def step(self, step: int) -> StepOutcome:
        self.opt.zero_grad(set_to_none=True)
        loss, logged, samples = micro_steps(self.ctx, self.model, self.batches, self.tools, step)
        self.samples_per_step = self.samples_per_step or samples  # the first step's batches, as measured
        lr = self.tools.lr(self.opt)
        stepped = self.tools.step(self.opt, lambda: list(self.model.parameters()))
        return StepOutcome(
            loss,
            self.sent,
            self.sent,
            sent_remote=self.remote,
            logged=logged,
            lr=lr,
            stepped=stepped,
            samples=self.samples_per_step,
        )

    def evaluate(self, steps_done: int) -> None:
        state = full_state(self.model)  # every worker gathers; rank 0 evaluates a CPU copy
        evaluate_during_training(
            self.job, self.cfg, self.ctx.rank, steps_done, lambda: cpu_model(self.ctx, state), self.ctx.report_eval
        )

    def save(self, steps_done: int) -> None:
        save_state(self.ctx, steps_done, self.model, self.opt, self.tools)  # each rank its shards

    def write_final(self) -> None:
        run_state.write_final(
            self.cfg.run_dir, run_state.model_entries(self.model)
        )  # each rank its shards (RUN_DIR/model)

    def result(self, meter: StepMeter) -> TrainResult:
        ctx = self.ctx
        # evaluate() takes the whole model: gathered to rank 0's host memory, only when the script
        # has one to run (a transformers model's RUN_DIR/hf then too; else `hpar export --format hf`)
        state = full_state(self.model) if self.cfg.eval else None
        result = meter.result(
            cpu_model(ctx, state) if ctx.rank == 0 and state is not None else None,
            replicas=ctx.world_size,
            extra={"fsdp_units": len(self.wrapped)},
        )
        if ctx.rank == 0 and state is None:
            result.eval_last = {}
        dist.barrier()
        return result


def train(ctx: WorkerContext) -> TrainResult:
    """Train ``ctx.cfg.steps`` optimizer steps with FSDP2 (module docstring; :class:`FsdpStep`
    in the training spine); N workers equal one process on the concatenated batches with a
    mean loss, with the script's schedule, clipping, accumulation and bf16 autocast."""
    return spine.train(ctx, FsdpStep(ctx))
