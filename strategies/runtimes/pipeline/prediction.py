"""Which weights a pipeline pass uses: live weights, stashed versions (PipeDream) or
predicted weights (SpecTrain).

In asynchronous 1F1B (PipeDream, Narayanan et al., SOSP 2019) a stage updates its weights after
every backward, while several micro-batches are between their forward and their backward, so
micro-batch j's forward at stage k sees weights s versions older than the ones its own update is
made against (s from ``schedules.with_distances``: K-1-k on the 1F1B order). Modes:

- ``sync``: the module's own parameters (gpipe/1f1b: no update inside a step).
- ``async``: no correction; the backward reads the weights current at backward time.
- ``stash``: weight stashing (PipeDream): the backward uses the copy its forward ran on;
  stage k holds up to K-k versions.
- ``predict``: weight prediction (SpecTrain, Chen, Yang, Cheng, "Efficient and Robust Parallel
  DNN Training through Model Parallelism on Multi-GPU Platform", arXiv 1809.02839, eq. 6): a
  pass with version distance s runs on ``W_hat = W - s * lr * v``, v the optimizer's own update
  direction (strategies/runtimes/pipeline/velocity.py); the backward reads the live weights.
- ``2bw``: PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training",
  ICML 2021): a batch's gradients are applied once, every micro-batch of batch b running on
  version b-1; needs M >= K-1.

How the asynchronous modes run a pass (``torch.func.functional_call`` on leaf tensors, a
saved-tensor hook for ``predict``) and its one limit: docs/pipelines.md, "How it works".
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call

from hpar.strategies.runtimes.pipeline.velocity import needs_last_grad, velocity

from hpar.strategies.job.optimizer_rules import check_predictable

MODES = ("sync", "async", "stash", "predict", "2bw")


def mode_for_schedule(schedule: str) -> str:
    """The weight mode of a pipeline schedule name."""
    return {
        "gpipe": "sync",
        "1f1b": "sync",
        "async": "async",
        "async-stash": "stash",
        "async-predict": "predict",
        "async-2bw": "2bw",
    }[schedule]


class PassWeights:
    """The weights of one stage's passes and its optimizer steps.

    ``module``: the stage's layers; ``optimizer``: over ``module.parameters()``; ``mode``:
    one of MODES (None for a stage without parameters); ``micro_batches``: M, micro-batches
    per batch (2bw's versions are per batch). Use :meth:`forward`, :meth:`backward` and
    :meth:`step`. Raises ValueError for ``predict`` with an optimizer without a rule.
    """

    def __init__(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, mode: str, micro_batches: int = 1
    ):
        assert mode in MODES, mode
        if mode == "predict":
            check_predictable(optimizer)
        self.module, self.optimizer, self.mode, self.micro_batches = module, optimizer, mode, micro_batches
        self.versions: dict[int, dict[str, torch.Tensor]] = {}  # 2bw: stashed version -> weights
        self.version_of: dict[int, int] = {}  # 2bw: micro-batch -> its version
        self.live_version = 0  # 2bw: updates applied so far
        self.most_versions = 0  # 2bw: most stashed versions held
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.leaves: dict[int, dict[str, torch.Tensor]] = {}  # micro-batch -> pass weights
        self._last_grad: dict[str, torch.Tensor] = {}  # plain SGD's v, predict only
        self._scratch: dict[str, torch.Tensor] = {}  # W_hat of a predicted forward, or the real W

    # --- passes ---------------------------------------------------------------------------
    def forward(self, micro: int, distance: int, inputs: Any) -> Any:
        """Run the stage's forward for ``micro`` with version distance ``distance`` (s)."""
        if self.mode == "sync":
            return self.module(inputs)
        if self.mode == "stash":
            leaves = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.named}
        elif self.mode == "2bw":
            leaves = {n: t.detach().requires_grad_(True) for n, t in self._version_for(micro).items()}
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
                leaves[n] = buf.detach().requires_grad_(True)  # a fresh leaf on the buffer
                live[buf.untyped_storage().data_ptr()] = p
        return live

    def _velocities(self):
        """``(name, parameter, v, lr, buffer)`` for every parameter whose v is known, with a
        per-parameter buffer of its shape reused from pass to pass (no allocation per pass)."""
        group = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for n, p in self.named:
            v = velocity(self.optimizer, group[id(p)], p, self._last_grad.get(n))
            if v is None:
                continue
            buf = self._scratch.get(n)
            if buf is None or buf.shape != p.shape:
                buf = self._scratch[n] = torch.empty_like(p)
            yield n, p, v, group[id(p)]["lr"], buf

    def _version_for(self, micro: int) -> dict[str, torch.Tensor]:
        """2bw: the weights of version max(b-1, 0) for micro-batch ``micro`` of batch b,
        stashing the live weights when they are that version."""
        want = max(micro // self.micro_batches - 1, 0)
        assert want <= self.live_version, "async-2bw needs --micro-batches >= stages - 1"
        if want not in self.versions:
            assert want == self.live_version, f"version {want} was not kept"
            self.versions[want] = {n: p.detach().clone() for n, p in self.named}
        self.version_of[micro] = want
        self.most_versions = max(self.most_versions, len(self.versions))
        return self.versions[want]

    def backward(self, micro: int, distance: int, tensors, grads=None) -> None:
        """Backpropagate ``tensors`` (with ``grads``, None for a scalar loss) of ``micro``;
        the parameters' ``.grad`` accumulate (sync, 2bw) or are set to this micro-batch's
        gradient (the other asynchronous modes)."""
        with self.predicted(distance if self.mode == "predict" else 0):
            torch.autograd.backward(tensors, grads)
        if self.mode == "sync":
            return
        leaves = self.leaves.pop(micro)
        for n, p in self.named:
            g = leaves[n].grad
            if self.mode == "2bw" and p.grad is not None:  # 2bw accumulates the batch's gradient
                p.grad = p.grad if g is None else p.grad + g
            else:
                p.grad = g
            leaves[n].grad = None
        if self.mode == "2bw":
            self.version_of.pop(micro)

    def in_flight(self) -> int:
        """Micro-batches between their forward and backward (stashed versions in stash mode)."""
        return len(self.leaves)

    # --- updates --------------------------------------------------------------------------
    def step(self, opt_step=None) -> None:
        """One optimizer step with the accumulated ``.grad``, then clear them. ``opt_step``:
        what steps the optimizer (default ``optimizer.step``; the GradScaler's ``step`` under fp16)."""
        if self.mode == "2bw":
            self._retire_versions()
        if self.optimizer is None:
            return
        if self.mode == "predict" and needs_last_grad(self.optimizer):
            # plain SGD's v is the last gradient: keep a reference (no copy)
            self._last_grad.update({n: p.grad for n, p in self.named if p.grad is not None})
        (opt_step or self.optimizer.step)()
        self.optimizer.zero_grad(set_to_none=True)

    def _retire_versions(self) -> None:
        """2bw, before the update live_version -> live_version + 1: stash the live weights
        (the next batch's version) and drop versions no in-flight micro-batch uses."""
        if self.live_version not in self.versions and self.named:
            self.versions[self.live_version] = {n: p.detach().clone() for n, p in self.named}
        used = set(self.version_of.values())
        for u in [u for u in self.versions if u < self.live_version and u not in used]:
            del self.versions[u]
        self.most_versions = max(self.most_versions, len(self.versions))
        self.live_version += 1

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
