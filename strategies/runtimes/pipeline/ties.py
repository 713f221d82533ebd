"""A parameter held by several pipeline stages (weight tying across stages) kept as one.

GPT-2 and BERT tie their output projection to the token embedding (``lm_head.weight`` is
``transformer.wte.weight``; Press & Wolf 2017). Cut into stages, the embedding lands on the
first stage and the projection on the last, so both stages hold the parameter, and each
computes only its own part of its gradient (torch.distributed.pipelining's tracer even makes
each a separate copy; ``strategies/job/traced.py`` maps them back to the one parameter). Stepped
on those parts alone the copies drift apart after the first step. The rule here is
Megatron-LM's and DeepSpeed's (Megatron ``finalize_model_grads``: an AllReduce of the shared
embedding's gradient over the first and last stage; DeepSpeed ``TiedLayerSpec`` /
``allreduce_tied_weight_gradients``):

* the copies start equal: every stage builds the whole model from the same seed (and a
  resume loads every stage's copy from one step);
* before clipping and the optimizer step, each copy's gradient is replaced by the SUM of the
  copies' gradients over the stages that hold it (an AllReduce over a group of those stages'
  ranks, one group per pipeline replica, on the workers' dense backend: the gradients live
  on the device), so each stage steps on the gradient one process would compute, and the
  copies stay bitwise equal;
* the global clipping norm counts the parameter once (on the first stage holding it; Megatron
  PR 7228 fixed an over-clip by sqrt(2) from counting both copies).

Only the synchronous schedules (gpipe, 1f1b) step all stages together; an asynchronous stage
applies micro-batch j's update at its own time, so two copies could only agree by waiting for
each other at every update (a flush per micro-batch). Asynchronous schedules with a parameter
shared across stages are refused before start (``strategies/plan/stage_cuts.check_schedule``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpar.strategies.common.groups import dense_backend


class TiedGradients:
    """This stage's side of every shared parameter (``shared``: :func:`shared_across_stages`
    of the whole model this stage was cut from, in this process).

    ``module``: this stage's module; ``stage``/``replica``: its place in ``grid``
    (strategies/runtimes/pipeline/replicas.Grid); ``device_type``: the workers' (the groups' backend).
    Creating it creates one process group per (set of stages, replica), a collective over
    the default group: every worker builds it with the same ``shared``, in the same order."""

    def __init__(self, shared: dict, module: torch.nn.Module, grid, stage: int, replica: int, device_type: str):
        mine = {id(p) for p in module.parameters()}
        groups = {}
        for stages in sorted({stages for stages, _ in shared.values()}):
            for r in range(grid.replicas):
                ranks = [grid.rank_of(k, r) for k in stages]
                group = dist.new_group(ranks, backend=dense_backend(device_type))
                if r == replica and stage in stages:
                    groups[stages] = group
        self.tied = [
            (p, groups[stages], stages[0] == stage)
            for stages, p in shared.values()
            if stage in stages and id(p) in mine
        ]
        assert len(self.tied) == sum(stage in stages for stages, _ in shared.values()), (
            "a shared parameter is not this stage's"
        )
        self.not_counted = {id(p) for p, _, first in self.tied if not first}

    def sum_gradients(self) -> int:
        """Replace each shared parameter's gradient by its sum over the stages holding it (a
        zero gradient where a stage's passes did not reach it). Returns the bytes this stage
        sent (as many are received): one gradient per shared parameter to each other holder."""
        sent = 0
        for p, group, _ in self.tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
            sent += p.grad.numel() * p.grad.element_size() * (dist.get_world_size(group) - 1)
        return sent

    def counted(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` without the shared ones another stage counts in the clipping norm."""
        return [p for p in params if id(p) not in self.not_counted]


__all__ = ["TiedGradients"]
