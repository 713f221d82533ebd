"""``--precision fp16`` under ``hybrid`` and ``ps``: the gradient scaler's inf/NaN check covers
the rows pushed to the parameter servers, and the decision is agreed before any push.

One optimizer step of a worker (PyTorch's AMP recipe, with the servers' share added):

1. backward of the scaled loss (``GradScaler.scale``); nothing is pushed from inside the
   backward (the early pushes of hybrid/worker_step.py are off under fp16);
2. ``scaler.unscale_`` of the dense optimizer (torch checks the dense gradients, which DDP
   has already averaged); the rows and whole tables this worker would push are unscaled by
   the same factor and checked with the same torch kernel
   (``torch._amp_foreach_non_finite_check_and_unscale_``);
3. the flags are reduced (MAX) over the workers, so every worker takes the same decision; on
   inf/NaN anywhere, the scaler's record for the dense optimizer is set, so ``scaler.step``
   skips it and ``scaler.update`` backs off the scale on every worker alike (torch's
   ``ShardedGradScaler`` AllReduces the same record in place);
4. a skipped step pushes nothing: a server closes a step without pushes without touching its
   shard (no optimizer step, Adam's step count unchanged), while its replay of the script's LR
   schedule advances with the step index, as the workers' ``scheduler.step()`` does on a
   skipped step (torch's recipe steps the schedule every iteration; ``scaler.step`` only skips
   ``optimizer.step``). Master weights and optimizer state stay fp32 on the servers: they only
   ever receive unscaled fp32 gradients.

The rows are checked on the workers rather than on the servers because the decision must be
taken before any push; a server's gradient is the mean of the workers' pushes, finite when
they are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def placeholder_optimizer(device: torch.device) -> torch.optim.Optimizer:
    """An optimizer over one zero parameter with a zero gradient and lr 0 (its steps change
    nothing), for a worker without dense parameters (``ps``): the scaler needs one optimizer
    to record the agreed decision in and to update its scale."""
    p = torch.zeros(1, device=device, requires_grad=True)
    p.grad = torch.zeros_like(p)
    return torch.optim.SGD([p], lr=0.0)


def unscale_and_agree(
    scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer, pushed: list[torch.Tensor], group
) -> bool:
    """Steps 2-3 of the module docstring: unscale ``opt``'s gradients and, in place, the
    gradients about to be pushed (``pushed``: row gradients and whole tables, any device),
    reduce the inf/NaN flag (MAX) over ``group`` (the workers' gloo control group: a CPU
    float) and record it for ``opt``. A collective: every worker calls it once per step.
    Returns True when the step is skipped (on every worker)."""
    scaler.unscale_(opt)
    inv = 1.0 / scaler.get_scale()
    found = torch.zeros(1)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in pushed:
        by_device.setdefault(g.device, []).append(g)
    for device, grads in by_device.items():
        flag = torch.zeros(1, device=device)
        inv_t = torch.full((1,), inv, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_t)
        found = torch.maximum(found, flag.cpu())
    # torch's own record of this step's check on opt (what ShardedGradScaler reduces too)
    record = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    for t in record.values():
        found = torch.maximum(found, t.detach().float().cpu().reshape(1))
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    for t in record.values():
        t.fill_(float(found))
    return bool(found.item())
