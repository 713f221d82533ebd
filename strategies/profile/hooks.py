"""Measurement hooks for :mod:`hpar.strategies.profile.profiler`: per-layer timing through module
and tensor hooks, FLOP counting (torch.utils.flop_counter plus an analytic count for fused
RNN kernels), gradient row counting, and the choice of a timing batch small enough for the time budget.
No policy here, only instruments."""

from __future__ import annotations

import time

import torch
from hpar.strategies.job.contract import Job
from hpar.strategies.job.forward import call_model
from hpar.strategies.job.tying import embedding_tables
from torch import nn

STEP_BUDGET_S = 0.5  # longest timed step before timing moves to a smaller batch
MIN_TIMED_BATCH = 2  # no training-mode forward on one sample: BatchNorm refuses it


def embedding_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every nn.Embedding / nn.EmbeddingBag of ``model`` whose weight is row-sparse, with its
    qualified name (a weight tied to a dense user is measured as a dense parameter:
    ``strategies/job/tying.py``)."""
    return embedding_tables(model)


def rows_touched(grad: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(fraction of rows with a non-zero gradient value, boolean row mask); rows = dim 0."""
    mask = grad.reshape(grad.shape[0], -1).ne(0).any(1)
    return float(mask.float().mean()), mask


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
    elif hasattr(obj, "data") and isinstance(getattr(obj, "data"), torch.Tensor):  # PackedSequence
        yield obj.data


class LayerTimer:
    """Forward/backward seconds and output bytes per layer through module and tensor hooks
    (see the module docstring); also counts embedding-module calls per forward pass. Time
    points come from ``clock`` (strategies/devices.DeviceClock: CUDA events on a GPU, whose
    hooks only queue work; the host clock on the CPU)."""

    def __init__(self, layers, emb_modules, clock=None):
        from hpar.strategies.common.devices import DeviceClock

        self.clock = clock or DeviceClock(torch.device("cpu"))
        self.layers, self.embs = [m for _, m in layers], list(emb_modules)
        self.activation_bytes = [0] * len(self.layers)
        self.max_calls = 0
        self.min_calls = 1 << 30
        self._handles = []
        self.reset()

    def reset(self):
        if getattr(self, "_calls", None) and sum(self._calls.values()) > 0:  # a forward pass ran
            self.max_calls = max(self.max_calls, max(self._calls.values()))
            self.min_calls = min(self.min_calls, min(self._calls.values()))
        self._f = [[] for _ in self.layers]  # (start, end) marks of each forward call
        self._t = [None] * len(self.layers)
        self._b: dict = {}  # layer -> mark of its output gradient
        self._calls = {id(m): 0 for m in self.embs}

    def __enter__(self):
        for i, m in enumerate(self.layers):
            self._handles.append(m.register_forward_pre_hook(lambda mod, a, i=i: self._pre(i)))
            self._handles.append(m.register_forward_hook(lambda mod, a, out, i=i: self._post(i, out)))
        for m in self.embs:
            self._handles.append(m.register_forward_pre_hook(lambda mod, a: self._count(mod)))
        return self

    def __exit__(self, *exc):
        self.reset()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _count(self, mod):
        self._calls[id(mod)] += 1

    def _pre(self, i):
        self._t[i] = self.clock.mark()

    def _post(self, i, out):
        self._f[i].append((self._t[i], self.clock.mark()))
        ts = list(_tensors(out))
        self.activation_bytes[i] = sum(t.numel() * t.element_size() for t in ts)
        for t in ts:
            if t.requires_grad:
                t.register_hook(lambda g, i=i: self._grad_ready(i))

    def _grad_ready(self, i):
        if i not in self._b:
            self._b[i] = self.clock.mark()

    def forward_s(self) -> list[float]:
        return [sum(self.clock.between(a, b) for a, b in calls) for calls in self._f]

    def backward_s(self, end) -> list[float]:
        """Seconds from each layer's output-gradient event to the next event (or ``end``, a
        mark of ``clock`` taken when backward returned)."""
        to_end = sorted(((self.clock.between(m, end), i) for i, m in self._b.items()), reverse=True)
        out = [0.0] * len(self.layers)
        for k, (t, i) in enumerate(to_end):  # earliest event first
            out[i] = t - (to_end[k + 1][0] if k + 1 < len(to_end) else 0.0)
        return out

    def embedding_calls_once(self) -> bool:
        self.reset()
        return not self.embs or (self.max_calls == 1 and self.min_calls == 1)


def _rnn_forward_flops(m: nn.RNNBase, inputs) -> int:
    """Forward FLOPs of nn.LSTM/GRU/RNN: per token, layer and direction 2*G*H*(I + H_r)
    (G = 4 gates for LSTM, 3 for GRU, 1 for RNN) plus 2*H*P for an LSTM projection."""
    x = inputs[0]
    x = x.data if not isinstance(x, torch.Tensor) else x
    tokens = x.numel() // x.shape[-1]
    gates = {"LSTM": 4, "GRU": 3}.get(m.mode, 1)
    dirs = 2 if m.bidirectional else 1
    h_r = m.proj_size or m.hidden_size
    total = 0
    for layer in range(m.num_layers):
        i_size = m.input_size if layer == 0 else h_r * dirs
        per = 2 * gates * m.hidden_size * (i_size + h_r) + (2 * m.hidden_size * m.proj_size if m.proj_size else 0)
        total += per * dirs * tokens
    return total


def count_flops(model: nn.Module, layers, step) -> dict:
    """FLOPs of one ``step()`` (forward + loss, returning the loss; backward run here):
    {"forward": int, "backward": int, "layers": [fwd+bwd per layer]}."""
    from torch.utils.flop_counter import FlopCounterMode

    rnn_flops: dict[int, int] = {}
    rnns = [m for m in model.modules() if isinstance(m, nn.RNNBase)]
    hs = [
        m.register_forward_hook(
            lambda mod, a, o: rnn_flops.__setitem__(id(mod), rnn_flops.get(id(mod), 0) + _rnn_forward_flops(mod, a))
        )
        for m in rnns
    ]
    try:
        with FlopCounterMode(display=False) as fc:
            loss = step()
            fwd = fc.get_total_flops()
            loss.backward()
        total = fc.get_total_flops()
    finally:
        for h in hs:
            h.remove()
    counts = {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}
    root = type(model).__name__
    names = {id(m): n for n, m in model.named_modules()}
    per_layer = [counts.get(f"{root}.{names.get(id(m), '?')}", 0) for _, m in layers]
    for r in rnns:  # fused RNN kernels are invisible to the counter
        if counts.get(f"{root}.{names[id(r)]}", 0) == 0 and id(r) in rnn_flops:
            f = rnn_flops[id(r)]
            fwd, total = fwd + f, total + 3 * f
            for li, (_, m) in enumerate(layers):
                if any(x is r for x in m.modules()):
                    per_layer[li] += 3 * f
    return {"forward": fwd, "backward": total - fwd, "layers": per_layer}


def traced_layer_flops(layers, inputs) -> list[int]:
    """FLOPs of one step per layer of a traced model (``strategies/job/traced.py``): each layer's
    forward counted on its own (torch's FlopCounterMode), times 3 for forward plus backward
    (the backward of a matmul costs two of its forwards), as for fused RNN kernels above."""
    from torch.utils.flop_counter import FlopCounterMode

    out = []
    with torch.no_grad():
        for _, layer in layers:
            with FlopCounterMode(display=False) as fc:
                inputs = layer(inputs)
            out.append(3 * fc.get_total_flops())
    return out


def auto_timing_batch(job: Job, model: nn.Module, batch_size: int, workers: int) -> int:
    """``batch_size``, or a smaller batch when one step would exceed STEP_BUDGET_S. Times a
    warm step at batch b1 = max(2, batch_size // 32) and at b2 = min(batch_size, 4 b1) and
    extrapolates the line through them (a fixed cost per step plus a cost per sample: a
    sampled softmax's negatives cost the same at batch 2 as at batch 32). Never a batch of one
    sample unless ``batch_size`` is 1 (MIN_TIMED_BATCH: BatchNorm's training-mode forward
    refuses one sample per channel)."""
    small = max(MIN_TIMED_BATCH, batch_size // 32)
    if small >= batch_size:
        return batch_size
    big = min(batch_size, 4 * small)
    t_small, t_big = warm_step_s(job, model, small, workers), warm_step_s(job, model, big, workers)
    slope = max(t_big - t_small, 0.0) / (big - small)
    est = t_big + slope * (batch_size - big)
    return batch_size if est <= STEP_BUDGET_S else max(big, int(batch_size * STEP_BUDGET_S / est))


def _now(model: nn.Module) -> float:
    """The host clock once ``model``'s device has finished its queued work (synchronize
    around a timed region on CUDA)."""
    p = next(model.parameters(), None)
    if p is not None and p.device.type == "cuda":
        torch.cuda.synchronize(p.device)
    return time.perf_counter()


def warm_step_s(job: Job, model: nn.Module, batch: int, workers: int, repeats: int = 1) -> float:
    """Median seconds of ``repeats`` forward+loss+backward steps on rank 0's first batch of
    ``batch`` samples, after one untimed step (lazy initialisation); gradients are cleared."""
    inputs, targets = next(job.batches(0, workers, batch))
    times = []
    for i in range(repeats + 1):
        t0 = _now(model)
        job.compute_loss(call_model(model, inputs), targets).backward()
        if i:
            times.append(_now(model) - t0)
        model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def fixed_share(job: Job, model: nn.Module, batch: int, workers: int, repeats: int = 3) -> float:
    """Share of a step's compute that does not shrink with the batch, in [0, 1]: with warm
    steps t(b) = a + s b at ``batch`` and a quarter of it, a / t(batch). On a CPU a wide layer
    streams its weights whatever the batch, so a pipeline's micro-batch of B/M samples costs
    far more than 1/M of the batch (wide.py: 0.87 of it at M = 4); 0 for a batch under 4. The
    smaller batch has at least MIN_TIMED_BATCH samples (BatchNorm refuses one)."""
    if batch < 4:
        return 0.0
    quarter = max(MIN_TIMED_BATCH, batch // 4)
    full, part = warm_step_s(job, model, batch, workers, repeats), warm_step_s(job, model, quarter, workers, repeats)
    fixed = (part * batch - full * quarter) / (batch - quarter)
    return min(max(fixed / full, 0.0), 1.0) if full > 0 else 0.0
