"""Which weights a pipeline pass uses: live weights, stashed versions (PipeDream) or
predicted weights (SpecTrain).

In asynchronous 1F1B (PipeDream, Narayanan et al., SOSP 2019) a stage updates its weights
after every backward, while several micro-batches are between their forward and their
backward. Micro-batch j's forward at stage k therefore sees weights s versions older than
the ones its own update is made against (s from ``schedules.with_distances``: K-1-k on the
1F1B order). Modes:

- ``sync``: the module's own parameters (gpipe/1f1b: no update inside a step).
- ``async``: no correction. The forward uses the weights of that moment; the backward
  reads the weights current at backward time (later versions), as plain asynchronous
  pipelining does.
- ``stash``: weight stashing (PipeDream): the forward runs on a copy of the weights that
  the backward then uses too, so a micro-batch's gradient is consistent. Stage k holds
  up to K-k versions (one per in-flight micro-batch).
- ``predict``: weight prediction (SpecTrain, Chen, Yang, Cheng, "Efficient and Robust
  Parallel DNN Training through Model Parallelism on Multi-GPU Platform",
  arXiv 1809.02839, eq. 6). Before a pass with version distance s the stage sets::

      W_hat = W - s * lr * v

  where W are the live weights, lr the optimizer's learning rate of the parameter's group
  and v the smoothed gradient: SGD's momentum buffer (SGD with momentum moves the weights
  by exactly lr * v per update, so s updates with a steady v move them by s * lr * v).
  For other optimizers v is the last update divided by lr, ``(W_before - W_after) / lr``,
  which for plain SGD is the gradient of the last update. The real weights are restored
  right after the pass. The backward (s = 0 on 1F1B) reads the live weights.

Implementation: in the asynchronous modes a pass does not use the module's parameters
directly but leaf tensors handed to ``torch.func.functional_call``. For ``async`` they are
aliases of the parameters' storage (``p.data``, which has its own version counter), so the
optimizer's in-place updates are visible to a later backward without tripping autograd's
saved-tensor check; for ``stash`` they are clones. A ``predict`` forward computes
W_hat = W - s * lr * v out of place into a reused buffer (one pass over W and v, nothing
to restore) and runs on it; a saved-tensor hook (``torch.autograd.graph.saved_tensors_hooks``)
stores every weight the forward saves for backward as a reference to the live parameter,
so the backward reads the live weights, as with ``async``. After the backward the leaves'
gradients become the parameters' ``.grad``. Limit: a layer whose autograd saves a tensor
derived from a weight (rather than the weight or a view of it) keeps that derived value
from the forward.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call

MODES = ("sync", "async", "stash", "predict")


def mode_for_schedule(schedule: str) -> str:
    """The weight mode of a pipeline schedule name."""
    return {"gpipe": "sync", "1f1b": "sync", "async": "async", "async-stash": "stash",
            "async-predict": "predict"}[schedule]


class PassWeights:
    """The weights of one stage's passes and its optimizer steps.

    ``module``: the stage's layers; ``optimizer``: over ``module.parameters()``; ``mode``:
    one of MODES (None for a stage without parameters). Use :meth:`forward`, :meth:`backward` and :meth:`step`.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, mode: str):
        assert mode in MODES, mode
        self.module, self.optimizer, self.mode = module, optimizer, mode
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.leaves: dict[int, dict[str, torch.Tensor]] = {}   # micro-batch -> pass weights
        self._last_update: dict[str, torch.Tensor] = {}        # non-momentum v, predict only
        self._scratch: dict[str, torch.Tensor] = {}            # W_hat of a predicted forward, or the real W

    # --- passes ---------------------------------------------------------------------------
    def forward(self, micro: int, distance: int, inputs: Any) -> Any:
        """Run the stage's forward for ``micro`` with version distance ``distance`` (s)."""
        if self.mode == "sync":
            return self.module(inputs)
        if self.mode == "stash":
            leaves = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.named}
        else:
            leaves = {n: p.data.requires_grad_(True) for n, p in self.named}
        live = self._predict_into_scratch(leaves, distance) if self.mode == "predict" else {}
        self.leaves[micro] = leaves
        if not live:
            return functional_call(self.module, leaves, (inputs,))

        def pack(t: torch.Tensor):
            p = live.get(t.untyped_storage().data_ptr())
            return t if p is None else (p, t.size(), t.stride(), t.storage_offset())

        def unpack(x):
            return x if isinstance(x, torch.Tensor) else x[0].data.as_strided(x[1], x[2], x[3])
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return functional_call(self.module, leaves, (inputs,))

    def _predict_into_scratch(self, leaves: dict[str, torch.Tensor], distance: int) -> dict[int, torch.Tensor]:
        """Replace ``leaves`` by W_hat = W - s * lr * v in per-parameter buffers reused from
        pass to pass; returns {buffer storage address: live parameter} for the saved-tensor
        hook. A leaf stays the live weight where v is not known yet or s = 0."""
        if distance <= 0 or self.optimizer is None:
            return {}
        live = {}
        with torch.no_grad():
            for n, p, v, lr, buf in self._velocities():
                torch.add(p, v, alpha=-distance * lr, out=buf)
                leaves[n] = buf.detach().requires_grad_(True)   # a fresh leaf on the buffer
                live[buf.untyped_storage().data_ptr()] = p
        return live

    def _velocities(self):
        """``(name, parameter, v, lr, buffer)`` for every parameter whose v is known, with a
        per-parameter buffer of its shape reused from pass to pass (no allocation per pass)."""
        lr = {id(p): g["lr"] for g in self.optimizer.param_groups for p in g["params"]}
        for n, p in self.named:
            v = self.smoothed_gradient(n, p)
            if v is None:
                continue
            buf = self._scratch.get(n)
            if buf is None or buf.shape != p.shape:
                buf = self._scratch[n] = torch.empty_like(p)
            yield n, p, v, lr[id(p)], buf

    def backward(self, micro: int, distance: int, tensors, grads=None) -> None:
        """Backpropagate ``tensors`` (with ``grads``, None for a scalar loss) of ``micro``;
        the parameters' ``.grad`` accumulate (sync) or are set to this micro-batch's
        gradient (asynchronous modes)."""
        with self.predicted(distance if self.mode == "predict" else 0):
            torch.autograd.backward(tensors, grads)
        if self.mode == "sync":
            return
        leaves = self.leaves.pop(micro)
        for n, p in self.named:
            p.grad = leaves[n].grad
            leaves[n].grad = None

    def in_flight(self) -> int:
        """Micro-batches between their forward and backward (stashed versions in stash mode)."""
        return len(self.leaves)

    # --- updates --------------------------------------------------------------------------
    def step(self) -> None:
        """One optimizer step with the accumulated ``.grad``, then clear them."""
        if self.optimizer is None:
            return
        track = self.mode == "predict" and not _sgd_momentum(self.optimizer)
        plain = track and _plain_sgd(self.optimizer)
        # plain SGD moves W by exactly lr * grad, so v is the gradient itself: keep a
        # reference instead of copying the weights before the step (three memory passes)
        grads = {n: p.grad for n, p in self.named if p.grad is not None} if plain else None
        before = {n: p.detach().clone() for n, p in self.named} if track and not plain else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if plain:
            self._last_update.update(grads)
        elif track:
            lr = {id(p): g["lr"] for g in self.optimizer.param_groups for p in g["params"]}
            for n, p in self.named:
                self._last_update[n] = (before[n] - p.detach()) / lr[id(p)]

    def smoothed_gradient(self, name: str, param: torch.Tensor) -> torch.Tensor | None:
        """v for ``param``: SGD's momentum buffer, else the last update / lr; None before
        the first update."""
        if _sgd_momentum(self.optimizer):
            return self.optimizer.state.get(param, {}).get("momentum_buffer")
        return self._last_update.get(name)

    def predicted(self, distance: int) -> "_Predicted":
        """Context: live weights become W - s * lr * v inside, the real ones after."""
        return _Predicted(self, distance)


class _Predicted:
    def __init__(self, owner: PassWeights, distance: int):
        self.owner, self.distance, self.saved = owner, distance, None

    def __enter__(self):
        if self.distance <= 0 or self.owner.optimizer is None:
            return self
        self.saved = []
        with torch.no_grad():
            for _, p, v, lr, real in self.owner._velocities():
                real.copy_(p)
                self.saved.append((p, real))
                p.sub_(v, alpha=self.distance * lr)
        return self

    def __exit__(self, *exc):
        if self.saved:
            with torch.no_grad():
                for p, real in self.saved:
                    p.copy_(real)
        self.saved = None
        return False


def _plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """SGD without momentum, weight decay or maximize: its update is exactly -lr * grad."""
    return isinstance(optimizer, torch.optim.SGD) and all(
        not g.get("momentum", 0) and not g.get("weight_decay", 0) and not g.get("maximize", False)
        for g in optimizer.param_groups)


def _sgd_momentum(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, torch.optim.SGD) and all(g.get("momentum", 0) > 0 for g in optimizer.param_groups)
