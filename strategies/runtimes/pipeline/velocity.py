"""The update direction weight prediction extrapolates: per optimizer, the velocity v with
which one optimizer step moves a parameter by ``lr * v``.

Weight prediction (SpecTrain, Chen, Yang, Cheng, arXiv 1809.02839, eq. 6) sets the weights
of a pass with version distance s to ``W_hat = W - s * lr * v``: s more steps in the
direction of the last one. v must be the optimizer's own direction, or the prediction points
elsewhere than the weights go. Rules (the optimizer's state after its last step):

- ``torch.optim.SGD`` with momentum (torch's form ``buf = m * buf + (1 - d) * g``, with
  ``buf = g`` on the first step, weight decay folded into g): ``v = buf``; SGD moves W by
  exactly ``lr * buf`` (SpecTrain's smoothed gradient when d = m).
- ``SGD`` without momentum: ``v = g + wd * W`` with g the gradient of the last step.
- ``torch.optim.Adam`` / ``AdamW`` (Kingma and Ba, ICLR 2015, algorithm 1; Loshchilov and
  Hutter, ICLR 2019, algorithm 2; the direction XPipe, Guan et al. 2019, predicts with)::

      v = m_hat / (sqrt(v_hat) + eps) [+ wd * W for AdamW's decoupled weight decay]
      m_hat = exp_avg / (1 - beta1^t),  v_hat = exp_avg_sq / (1 - beta2^t)

  (``max_exp_avg_sq`` in place of ``exp_avg_sq`` with amsgrad).

Other optimizers (or ``maximize``, ``nesterov``) have no rule: ``optimizer_rules.check_predictable``
raises a ValueError for them before a run starts, rather than predicting with a direction
the optimizer does not take.
"""

from __future__ import annotations

import torch


def velocity(
    optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor, last_grad: torch.Tensor | None
) -> torch.Tensor | None:
    """v of ``param`` (in parameter ``group`` of ``optimizer``, already checked by
    ``optimizer_rules.check_predictable``): a tensor of the parameter's shape, or None before the
    optimizer's first step. ``last_grad``: the gradient of the last step (plain SGD only).
    The caller predicts ``W - s * group["lr"] * v``."""
    state = optimizer.state.get(param, {})
    if isinstance(optimizer, torch.optim.SGD):
        if group.get("momentum", 0):
            return state.get("momentum_buffer")
        if last_grad is None:
            return None
        wd = group.get("weight_decay", 0)
        return last_grad if not wd else last_grad + wd * param.detach()
    if "exp_avg" not in state:
        return None
    beta1, beta2 = group["betas"]
    t = float(state["step"])
    second = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
    denom = (second / (1 - beta2**t)).sqrt_().add_(group["eps"])
    v = (state["exp_avg"] / (1 - beta1**t)).div_(denom)
    if group.get("decoupled_weight_decay") or isinstance(optimizer, torch.optim.AdamW):
        wd = group.get("weight_decay", 0)
        if wd:
            v.add_(param.detach(), alpha=wd)
    return v


def needs_last_grad(optimizer: torch.optim.Optimizer | None) -> bool:
    """True for SGD without momentum, whose v is the last gradient (kept by reference)."""
    return isinstance(optimizer, torch.optim.SGD) and not all(g.get("momentum", 0) for g in optimizer.param_groups)
