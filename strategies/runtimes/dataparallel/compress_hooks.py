"""``--compress`` on the workers: torch's DDP communication hooks for the dense AllReduce
(``torch.distributed.algorithms.ddp_comm_hooks``: ``default_hooks.fp16_compress_hook`` /
``bf16_compress_hook``, ``powerSGD_hook.powerSGD_hook`` with a ``PowerSGDState``), wrapped so
that hpar still counts the bytes each bucket puts on the wire, and PowerSGD's state kept in the
run's checkpoint. The setting and its arithmetic: strategies/job/compression.py.

DDP takes one hook. Without ``--compress`` the strategy's own counting hook is registered as
before; with it, :func:`compressed_hook` counts the compressed bytes and calls torch's hook, and
hands a sparse bucket (``allreduce-sparse``'s tables) to the strategy's own hook unchanged.

PowerSGD's state in the checkpoint (``compress.worker<r>.*``, strategies/state/state.py):
the step counter, the NumPy generator that seeds each first Q, and per bucket the
error-feedback residual (this worker's own), the warm-start P and Q factors and the order of
the parameters they are laid out for. DDP's first step after a resume has its first-step
buckets, not the rebuilt ones the state was built on: :class:`Compressor` then runs torch's
hook on a copy in the saved order, so a resumed run trains as the run that went on, bit for
bit (where the first-step buckets hold other parameters than the rebuilt ones, as they may in
a model of several buckets, those buckets start afresh: a zero residual, new factors).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd

from hpar.strategies.job.compression import MIN_COMPRESSION_RATE, Compression, start_iter
from hpar.strategies.job.context import DENSE, ring_allreduce_bytes

_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


class Compressor:
    """A worker's ``--compress``: the hook it registers on DDP (:meth:`attach`) and the state
    it keeps (:meth:`entries`, :meth:`restore`). ``steps``: the run's optimizer steps (PowerSGD
    starts after :func:`~hpar.strategies.job.compression.start_iter` of them).

    torch keeps PowerSGD's residual and factors per bucket index, laid out in the bucket's
    order of parameters, and DDP lays its buckets out again after the first step (also a
    resumed run's). A bucket whose state was built under another order of the same parameters
    runs torch's hook on a copy in that order (:class:`_Relaid`), so the numbers are the ones
    the run that went on computes; a bucket of other parameters starts afresh."""

    def __init__(self, compression: Compression, steps: int, rank: int):
        self.c, self.steps, self.rank = compression, steps, rank
        self.state: psgd.PowerSGDState | None = None
        self.names: list[str] = []  # the DDP module's parameter names, in order
        self.index: dict[int, int] = {}  # id(parameter) -> its position in names
        self.layouts: dict[int, list[int]] = {}  # bucket index -> the parameters its state is laid out for
        self.saved: dict = {}  # restored before attach

    def attach(self, ddp, plain_state: tuple, plain_hook) -> None:
        """Register the hook on ``ddp``: ``plain_hook`` with ``plain_state`` (the strategy's
        counting AllReduce: (ByteMeter, world size, group, remote)) when off, else
        :func:`compressed_hook` around torch's."""
        if not self.c.on:
            ddp.register_comm_hook(plain_state, plain_hook)
            return
        group = plain_state[2]
        if self.c.kind == "powersgd":
            named = list(ddp.module.named_parameters())
            self.names, self.index = [n for n, _ in named], {id(p): i for i, (_, p) in enumerate(named)}
            self.state = psgd.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=self.c.rank,
                start_powerSGD_iter=start_iter(self.steps),
                min_compression_rate=MIN_COMPRESSION_RATE,
                use_error_feedback=True,
                warm_start=True,
                random_seed=0,
                compression_stats_logging_frequency=1 << 62,
            )
            self._apply_saved()
            inner = self
        else:
            inner = group
        ddp.register_comm_hook(
            (plain_state, plain_hook, inner, _HOOKS.get(self.c.kind, psgd.powerSGD_hook)), compressed_hook
        )

    def run(self, bucket):
        """torch's PowerSGD hook on ``bucket``, on a copy laid out as its state was built where
        DDP's layout of the same parameters differs; a bucket of other parameters than its
        state's drops that state (zero residual, new factors)."""
        s, b = self.state, bucket.index()
        order = [self.index[id(p)] for p in bucket.parameters()]
        device = bucket.buffer().device
        for d in (s.error_dict, s.p_memory_dict, s.q_memory_dict):  # restored on the CPU: to the gradients' device
            if b in d and d[b].device != device:
                d[b] = d[b].to(device)
        if b not in s.error_dict:
            fut = psgd.powerSGD_hook(s, bucket)
            if b in s.error_dict:
                self.layouts[b] = order  # the layout its state is built under from now on
            return fut
        built = self.layouts.get(b, order)
        if built == order:
            return psgd.powerSGD_hook(s, bucket)
        if sorted(built) != sorted(order):
            for d in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
                d.pop(b, None)
            return self.run(bucket)
        relaid = _Relaid(bucket, [order.index(i) for i in built])
        return psgd.powerSGD_hook(s, relaid).then(relaid.copy_back)

    # -- PowerSGD's state in the checkpoint ------------------------------------------------

    def _prefix(self) -> str:
        return f"compress.worker{self.rank}"

    def entries(self) -> dict:
        """PowerSGD's state in the checkpoint namespace (empty for another kind, or before
        :meth:`attach`): ``.meta`` [step counter, generator position, has_gauss], ``.gauss``
        and ``.key`` (the NumPy generator's), and per bucket index b ``.error.<b>``, ``.p.<b>``,
        ``.q.<b>`` and ``.layout.<b>`` (its parameters' positions in the module's order)."""
        s = self.state
        if s is None:
            return {}
        _, key, pos, has_gauss, gauss = s.rng.get_state()
        pre = self._prefix()
        out = {
            f"{pre}.meta": torch.tensor([s.iter, pos, has_gauss], dtype=torch.int64),
            f"{pre}.gauss": torch.tensor([gauss], dtype=torch.float64),
            f"{pre}.key": torch.from_numpy(key.astype(np.int64)),
        }
        for name, d in (("error", s.error_dict), ("p", s.p_memory_dict), ("q", s.q_memory_dict)):
            out.update({f"{pre}.{name}.{b}": t.detach().cpu().clone() for b, t in d.items()})
        out.update({f"{pre}.layout.{b}": torch.tensor(order, dtype=torch.int64) for b, order in self.layouts.items()})
        return out

    def restore(self, path: str) -> None:
        """Read this worker's PowerSGD state from the checkpoint in ``path`` where it holds it
        (a worker that did not exist then, or another kind, starts afresh)."""
        if self.c.kind != "powersgd":
            return
        from hpar.strategies.state import safe_read, state as run_state

        saved = safe_read.read_metadata(path).state_dict_metadata  # as data, not code
        pre = self._prefix()
        if f"{pre}.meta" not in saved:
            return
        want = {
            k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
            for k, v in saved.items()
            if k.startswith(pre + ".") and hasattr(v, "size")
        }
        run_state.read(path, want)
        self.saved = want
        if self.state is not None:
            self._apply_saved()

    def _apply_saved(self) -> None:
        s, pre, saved = self.state, self._prefix(), self.saved
        if not saved:
            return
        it, pos, has_gauss = (int(v) for v in saved.pop(f"{pre}.meta"))
        s.iter = it
        s.rng.set_state(
            (
                "MT19937",
                saved.pop(f"{pre}.key").numpy().astype(np.uint32),
                pos,
                has_gauss,
                float(saved.pop(f"{pre}.gauss")[0]),
            )
        )
        dicts = {"error": s.error_dict, "p": s.p_memory_dict, "q": s.q_memory_dict}
        for k, t in saved.items():  # on the CPU until the bucket's first hook (run) moves it to its device
            kind, _, b = k[len(pre) + 1 :].partition(".")
            if kind == "layout":
                self.layouts[int(b)] = [int(i) for i in t]
            else:
                dicts[kind][int(b)] = t
        self.saved = {}


class _Relaid:
    """A stand-in for a DDP ``GradBucket`` whose parameters sit in another order: its
    gradients copied, in that order (``perm[i]``: the bucket's i-th gradient's position in
    DDP's), into a new flat buffer; :meth:`copy_back` writes the result into DDP's."""

    def __init__(self, bucket, perm: list[int]):
        self.bucket = bucket
        grads = bucket.gradients()
        self.flat = torch.cat([grads[j].reshape(-1) for j in perm])
        self.views, at = [], 0
        for j in perm:
            self.views.append(self.flat[at : at + grads[j].numel()].view_as(grads[j]))
            at += grads[j].numel()
        self.perm = perm

    def buffer(self):
        return self.flat

    def gradients(self):
        return self.views

    def index(self):
        return self.bucket.index()

    def is_last(self):
        return self.bucket.is_last()

    def copy_back(self, fut):
        grads = self.bucket.gradients()
        for view, j in zip(self.views, self.perm):
            grads[j].copy_(view)
        return self.bucket.buffer()


def powersgd_wire(state: psgd.PowerSGDState, bucket) -> int:
    """Bytes one PowerSGD step of ``bucket`` AllReduces (before the ring's factor), as torch's
    hook splits it: plain AllReduce before ``start_powerSGD_iter``; then the uncompressed
    tensors, the P factors and the Q factors (three AllReduces)."""
    buf = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        return buf.numel() * buf.element_size()
    total = 0
    for t in bucket.gradients():
        n = t.shape[0] if t.dim() else 1
        m = t.numel() // n if n else 0
        r = min(n, m, state.matrix_approximation_rank)
        total += (n + m) * r if t.dim() > 1 and (n + m) * r * state.min_compression_rate < n * m else t.numel()
    return total * buf.element_size()


def compressed_hook(state, bucket):
    """DDP communication hook: torch's compressing hook, counting this worker's bytes.

    ``state`` is (the plain hook's state (ByteMeter, N, group, remote), the plain hook,
    torch's hook's state (PowerSGD: the :class:`Compressor` holding it), torch's hook); ``bucket`` a dist.GradBucket (unannotated: DDP
    rejects string annotations). A sparse bucket goes to the plain hook as it is; a dense one
    costs ring AllReduce bytes 2(N-1)/N * B of its compressed size B."""
    plain_state, plain_hook, inner, torch_hook = state
    buf = bucket.buffer()
    if buf.is_sparse:
        return plain_hook(plain_state, bucket)
    counter, world_size, _, remote = plain_state
    wire = powersgd_wire(inner.state, bucket) if isinstance(inner, Compressor) else buf.numel() * 2
    nbytes = ring_allreduce_bytes(wire, world_size)
    counter.add(DENSE, sent=nbytes, recv=nbytes, remote=remote)
    return inner.run(bucket) if isinstance(inner, Compressor) else torch_hook(inner, bucket)


__all__ = ["Compressor", "compressed_hook", "powersgd_wire"]
