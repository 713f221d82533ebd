"""The training loop's cross-stage parts for the pipeline strategy: global-norm clipping and
fp16's inf/NaN check over the stages, ``evaluate`` during training on the whole model, and
the script's ``log()`` hook at the last stage.

Every function that reduces takes the process group to reduce over: the stages of one pipeline
(with replicas, the stages of one replica, after the replicas' AllReduce of each stage's
gradients). Tensors reduced over the workers' dense group stay on the worker's device (NCCL on
CUDA); the weights gathered for ``evaluate`` are CPU copies over a gloo group.

Invariants. Synchronous schedules (gpipe, 1f1b) step every stage once per batch as one process
would (PyTorch's AMP recipe: scale the loss, unscale, clip, step unless inf/NaN, update the
scale): the found-inf flags are AllReduced over the stages (torch's ``ShardedGradScaler``), so
every stage skips the same steps and holds the same scale, and the clipping norm is the whole
model's (the stages' sums of squares AllReduced, torch's coefficient ``min(1, max_norm / (norm +
1e-6))``). Asynchronous schedules apply a micro-batch's update at different times on each stage,
so a cross-stage norm or flag would be a flush per update: they clip per stage, to ``max_norm *
u / M`` for an update of u of the batch's M micro-batches (nothing is clipped where the
synchronous global norm stays under ``max_norm``), and refuse fp16 (bf16 needs no scaler). The
LR schedule steps with every optimizer step of a stage. User-facing rules: docs/pipelines.md,
"The training loop in a pipeline".
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from hpar.strategies.job.config import RunConfig
from hpar.strategies.common.devices import cpu_copy
from hpar.strategies.common.gather import gather_state_dicts
from hpar.strategies.job.loop import StepTools


def grad_sq_sum(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of the gradients of ``params`` as a float32 tensor of shape (1,) on
    ``device`` (zero for no gradients), without a host synchronisation."""
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None:
            total += p.grad.detach().float().pow(2).sum()
    return total


def clip_across_stages(
    params: list[torch.Tensor],
    max_norm: float,
    group,
    device: torch.device,
    copies: int = 1,
    counted: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Clip this stage's gradients by the global 2-norm over every stage of ``group``: the
    sums of squares are AllReduced (SUM) over ``group``, then every gradient is multiplied by
    ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does on one
    process. ``copies``: how many ranks of ``group`` hold each stage's (replica-averaged,
    hence equal) gradient, R for a pipeline of R replicas over all K x R workers; the sum is
    divided by it. A collective: every stage of ``group`` calls it, also one without
    parameters (``params`` empty). ``counted``: the parameters whose gradients this stage counts
    in the norm (default ``params``; a weight shared with an earlier stage is counted there
    only, strategies/runtimes/pipeline/ties.py). Returns the total norm before clipping, shape (1,), on
    ``device``."""
    sq = grad_sq_sum(params if counted is None else counted, device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    norm = (sq / copies).sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return norm


def async_clip_threshold(cfg: RunConfig, micro_per_update: int) -> float:
    """The per-stage clipping threshold of an asynchronous schedule (module docstring):
    ``clip_grad_norm * micro_per_update / micro_batches``."""
    return cfg.clip_grad_norm * micro_per_update / cfg.micro_batches


class StageStepper:
    """One stage's optimizer steps under the training-loop flags (module docstring).

    ``tools``: the stage's StepTools (:func:`stage_tools`: its scaler is a
    ``ShardedGradScaler`` over ``group``); ``opt``: the stage's optimizer, or for a stage
    without parameters a placeholder (:func:`placeholder_optimizer`) that keeps its scaler in
    every found-inf AllReduce; ``group``: the stages to agree with (None: one stage);
    ``sync``: whether the schedule steps all stages once per batch (gpipe/1f1b);
    ``micro_per_update``: micro-batches per update (asynchronous schedules); ``copies``: the
    pipeline's replicas R when ``group`` holds all K x R workers (:func:`clip_across_stages`).
    """

    def __init__(
        self,
        cfg: RunConfig,
        tools: StepTools,
        opt: torch.optim.Optimizer,
        group,
        device: torch.device,
        sync: bool,
        micro_per_update: int = 1,
        copies: int = 1,
    ):
        self.cfg, self.tools, self.opt, self.group, self.device = cfg, tools, opt, group, device
        self.sync, self.micro_per_update, self.copies = sync, micro_per_update, copies
        self.params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]  # frozen: no AllReduce
        self.norm_params = self.params  # those this stage counts in the global norm (ties.TiedGradients.counted)
        self.last_norm: torch.Tensor | None = None  # norm before clipping, shape (1,), when clipping

    def step(self, stage) -> bool:
        """Unscale, clip, step the stage's optimizer (``stage.update``), update the scale, step
        the schedule. In synchronous schedules a collective over ``group``, on every stage in
        the same order. Returns whether the optimizer stepped (False: inf/NaN, on every stage)."""
        tools, cfg, scaler = self.tools, self.cfg, self.tools.scaler
        params = self.params if stage.optimizer is not None else []
        if scaler.is_enabled():
            scaler.unscale_(self.opt)  # ShardedGradScaler: found-inf AllReduced over the stages
        if cfg.clip_grad_norm and self.sync:
            self.last_norm = clip_across_stages(
                params,
                cfg.clip_grad_norm,
                self.group,
                self.device,
                self.copies,
                counted=self.norm_params if params else [],
            )
        elif cfg.clip_grad_norm and params:
            self.last_norm = torch.nn.utils.clip_grad_norm_(params, async_clip_threshold(cfg, self.micro_per_update))
        return tools.scaled_step(lambda: stage.update(opt_step=lambda: scaler.step(self.opt)))


def placeholder_optimizer(device: torch.device) -> torch.optim.Optimizer:
    """An optimizer over one zero parameter with lr 0 (its steps change nothing), for a stage
    without parameters: its scaler then takes part in every found-inf AllReduce and follows
    the same scale as the others (the last stage scales the loss with it)."""
    return torch.optim.SGD([torch.zeros(1, device=device, requires_grad=True)], lr=0.0)


def stage_tools(cfg: RunConfig, job, opt: torch.optim.Optimizer | None, device: torch.device, group) -> StepTools:
    """The StepTools of one stage: the script's schedule on ``opt`` (none when ``opt`` is
    None), and for fp16 torch's ``ShardedGradScaler`` over ``group`` (found-inf flags summed
    over the stages), its scale initialised on every stage, not only on the last one that
    scales the loss. Raises JobError when ``scheduler()`` fails."""
    scaler = ShardedGradScaler(device.type, enabled=cfg.precision == "fp16", process_group=group)
    if scaler.is_enabled():
        scaler.scale(torch.zeros(1, device=device))
    return StepTools(cfg, device, scaler, job.build_scheduler(opt) if opt is not None else None)


def scale_loss(tools: StepTools) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The last stage's loss scaling for fp16 (``GradScaler.scale``), None otherwise."""
    return tools.scaler.scale if tools.scaler.is_enabled() else None


def gather_model(model: torch.nn.Module, module: torch.nn.Module, rank: int, group=None) -> torch.nn.Module | None:
    """The whole model with every stage's current weights, on the CPU, on stage 0 of
    ``group`` (None elsewhere): each stage sends a CPU copy of ``module``'s state dict (names,
    dtypes and shapes as JSON, the bytes as a tensor over ``group``, a gloo group: never a
    pickle, strategies/common/gather.py); stage 0 loads them into a CPU copy of ``model`` (the
    seeded whole model the stages were cut from). A collective over ``group``."""
    part = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        parts = [part]
    else:
        parts = gather_state_dicts(part, group=group, group_dst=0)
    if rank != 0:
        return None
    whole = cpu_copy(model)
    state = {}
    for p in parts:
        state.update(p)
    unexpected = whole.load_state_dict(state, strict=False).unexpected_keys
    assert not unexpected, unexpected
    return whole
