"""The compression's own compute per step, measured on the workers' device for ``--compress``
(strategies/job/compression.py): what a worker's DDP communication hook computes around its
AllReduces, for the model's dense gradient shapes, in seconds per step. The cost model
(strategies/plan/costmodel_compress.py) adds it to a compressed plan's step.

What is timed is the hook's own sequence of torch operations, without the AllReduces (those
the cost model prices from the link):

- ``fp16`` / ``bf16`` (torch's ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``):
  the bucket cast to 16 bits and divided by the world size, then copied back into the fp32 bucket.
- ``powersgd:R`` (torch's ``powerSGD_hook.powerSGD_hook``, layer-wise, error feedback and warm
  start on): the error added to the bucket and the bucket copied; the tensors it sends whole
  concatenated, divided and copied back; per compressed n x m matrix ``P = M Q`` (``torch.bmm``,
  as the hook), P orthogonalised with the hook's own ``_orthogonalize`` (Gram-Schmidt at rank
  <= 2, ``torch.linalg.qr`` above; private to torch, so ``torch.linalg.qr`` stands in where it
  is gone), ``Q = M^T P``, Q divided by the world size, ``M = P Q^T``; the new error
  ``copy - M``. The hook itself needs a process group, which the profile has not: these are the
  same operations at the run's rank, on tensors of the same shapes, one bucket holding them all.

Timed with :class:`~hpar.strategies.common.devices.DeviceClock` (CUDA events on a GPU), the
median of a few repeats after one warm-up, at the profile's thread count.
"""

from __future__ import annotations

import math
import statistics

import torch

from hpar.strategies.common.devices import DeviceClock
from hpar.strategies.job.compression import Compression, compression_work, wire_elements

MEASURED = (
    Compression("fp16"),
    Compression("bf16"),
    Compression("powersgd", 1),
    Compression("powersgd", 2),
    Compression("powersgd", 4),
)  # measured by every profile; a run's other rank is added to these


def _orthogonalize():
    """torch's PowerSGD orthogonalisation of a batch of matrices (in place), or QR in its place."""
    try:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize as orth

        return orth
    except ImportError:  # private to torch: the same work by QR
        return lambda m: torch.linalg.qr(
            m, out=(m, torch.empty(m.shape[0], m.shape[2], m.shape[2], dtype=m.dtype, device=m.device))
        )


def _half_step(flat: torch.Tensor, dtype: torch.dtype, world: int):
    """One 16-bit hook's compute: cast and divide, then the copy back."""

    def step():
        flat.copy_(flat.to(dtype).div_(world))

    return step


def _powersgd_step(flat: torch.Tensor, shapes: list[tuple[int, ...]], c: Compression, world: int):
    """One PowerSGD hook's compute (module docstring) on ``flat`` laid out as ``shapes``."""
    orth = _orthogonalize()
    error = torch.zeros_like(flat)
    gen = torch.Generator(device=flat.device).manual_seed(0)
    compressed, whole, at = [], [], 0
    for s in shapes:
        numel = math.prod(s) if s else 1
        view = flat[at : at + numel]
        at += numel
        if len(s) >= 2 and wire_elements(s, c)[0] < numel:
            n, m = s[0], numel // s[0]
            r = min(n, m, c.rank)
            q = torch.randn(1, m, r, generator=gen, device=flat.device)
            compressed.append((view.view(1, n, m), torch.empty(1, n, r, device=flat.device), q))
        else:
            whole.append(view)

    def step():
        flat.add_(error)
        copy = flat.clone()
        if whole:
            joined = torch.cat([t.view(-1) for t in whole]).div_(world)
            i = 0
            for t in whole:
                t.copy_(joined[i : i + t.numel()])
                i += t.numel()
        for t, p, q in compressed:
            torch.bmm(t, q, out=p)
        for _, p, _ in compressed:
            orth(p)
        for t, p, q in compressed:
            torch.bmm(t.transpose(1, 2), p, out=q)
            q.div_(world)
        for t, p, q in compressed:
            torch.bmm(p, q.transpose(1, 2), out=t)
        error.copy_(copy - flat)

    return step


def compression_seconds(
    shapes: list[tuple[int, ...]],
    device: torch.device,
    world: int,
    settings: tuple[Compression, ...] = MEASURED,
    repeats: int = 3,
) -> tuple[tuple[str, float], ...]:
    """Seconds of each compression's own compute per step (module docstring) for fp32 dense
    gradients of ``shapes`` on ``device`` among ``world`` workers: ``((str(setting),
    seconds), ...)`` in the order of ``settings`` (``off`` left out). ``()`` when there is no
    dense gradient. Allocates three copies of the gradients on ``device`` for the time of a
    measurement (the bucket, PowerSGD's error and its copy)."""
    numel = sum(math.prod(s) if s else 1 for s in shapes)
    if not numel:
        return ()
    clock, out = DeviceClock(device), []
    gen = torch.Generator(device=device).manual_seed(0)
    for c in settings:
        if not c.on:
            continue
        flat = torch.randn(numel, generator=gen, device=device)
        step = (
            _powersgd_step(flat, shapes, c, world)
            if c.kind == "powersgd"
            else _half_step(flat, torch.float16 if c.kind == "fp16" else torch.bfloat16, max(world, 1))
        )
        step()  # warm-up: first kernels, the allocator
        times = []
        for _ in range(repeats):
            a = clock.mark()
            step()
            times.append(clock.between(a, clock.mark()))
        out.append((str(c), float(statistics.median(times))))
        del flat, step
    return tuple(out)


def profile_compression(
    model: torch.nn.Module, tables: set[str], device: torch.device, world: int, extra: Compression | None = None
) -> tuple[tuple[str, float, float], ...]:
    """:func:`compression_seconds` of ``model``'s trainable parameters, apart for the dense
    layers and for the embedding tables named in ``tables`` (what ``allreduce`` compresses
    beside them; hybrid and allreduce-sparse compress the dense layers only): ``((setting,
    dense seconds, tables seconds), ...)`` for :data:`MEASURED` and ``extra`` (a run's other
    PowerSGD rank). A group over :data:`CAP` bytes is timed on the tensors that fit in it, in
    order, and scaled to the whole by its estimated work (``compression_work``); -1.0 where no tensor of it fits (the cost
    model then estimates it)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    settings = MEASURED + ((extra,) if extra is not None and extra.on and extra not in MEASURED else ())
    groups = []
    for shapes in (
        [tuple(p.shape) for n, p in named if n not in tables],
        [tuple(p.shape) for n, p in named if n in tables],
    ):
        timed, size = [], 0
        for s in shapes:
            if size + 4 * math.prod(s) <= CAP:
                timed.append(s)
                size += 4 * math.prod(s)
        got = dict(compression_seconds(timed, device, world, settings))
        groups.append(
            {
                str(c): (
                    got[str(c)] * compression_work(shapes, c) / compression_work(timed, c)
                    if timed
                    else (-1.0 if shapes else 0.0)
                )
                for c in settings
            }
        )
    return tuple((str(c), groups[0][str(c)], groups[1][str(c)]) for c in settings)


CAP = 256 * 2**20  # fp32 bytes of gradients timed at once (three copies on the device: 768 MiB)

__all__ = ["compression_seconds", "profile_compression", "MEASURED", "CAP"]
