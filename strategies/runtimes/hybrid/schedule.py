"""The learning-rate schedule on the parameter servers: the hyperparameters a server applies
to a table at step t equal those the worker's optimizer has at step t.

A server holds no copy of the workers' optimizer (its tables would keep the whole model in
memory), so it replays the script's ``scheduler(optimizer)`` on a shadow: an optimizer of the
user's class with the same parameter groups and hyperparameters, each group holding one
1-element dummy tensor. LR schedulers are functions of the step count and the groups' options
(torch.optim.lr_scheduler), so the shadow's groups after t scheduler steps are the workers'
(the learning rate, and whatever else a schedule moves, e.g. OneCycleLR's momentum / betas).
"""

from __future__ import annotations

import torch

from hpar.strategies.job.optimizer_rules import OptimizerSpec, spec_from_group
from hpar.strategies.job.contract import Job


class ServerSchedule:
    """Per-step optimizer hyperparameters of every parameter group of the user's optimizer."""

    def __init__(self, job: Job, opt: torch.optim.Optimizer):
        self.scheduler = None
        if job.scheduler_fn is None:
            return
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [torch.zeros(1)]} for g in opt.param_groups
        ]
        self.shadow = type(opt)(groups)
        self.scheduler = job.build_scheduler(self.shadow)
        self.groups: list[list[dict]] = []  # per step: every group's options (no params)

    def spec(self, group: int, step: int, base: OptimizerSpec) -> OptimizerSpec | None:
        """The update rule of param group ``group`` (index into ``optimizer.param_groups``) for
        optimizer step ``step`` (0-based), in ``base``'s sparse mode; None when the script has
        no ``scheduler()`` (then the table's own spec applies)."""
        if self.scheduler is None:
            return None
        while len(self.groups) <= step:
            self.groups.append([{k: v for k, v in g.items() if k != "params"} for g in self.shadow.param_groups])
            self.shadow.step()  # no gradients: changes nothing, but orders the step before the schedule's
            self.scheduler.step()
        return spec_from_group(self.shadow, self.groups[step][group], base.mode)


def group_index(opt: torch.optim.Optimizer, param: torch.Tensor) -> int:
    """Index of the param group of ``opt`` that holds ``param`` (AssertionError if none:
    ``ps_tables`` has already refused parameters outside every group)."""
    for i, g in enumerate(opt.param_groups):
        if any(p is param for p in g["params"]):
            return i
    raise AssertionError("parameter in no param group")
