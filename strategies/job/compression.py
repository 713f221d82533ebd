"""``--compress {off,fp16,bf16,powersgd[:RANK]}``: how the dense AllReduce of DDP's gradients
is compressed, as a small typed setting carried in the run config (RunConfig.compress), and
its arithmetic for the cost and memory models. Torch-free: the CLI checks the flag before it
imports torch; the workers attach torch's hooks (strategies/runtimes/dataparallel/compress_hooks.py).

- ``fp16`` / ``bf16``: each bucket cast to 16 bits, divided by the world size, AllReduced,
  cast back (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``): half the bytes.
- ``powersgd[:R]``: layer-wise rank-R compression with error feedback and warm start (Vogels,
  Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization", NeurIPS 2019; torch's ``powerSGD_hook``): an n x m gradient (a tensor viewed
  as ``shape[0] x rest``) travels as P (n x R) and Q (m x R) when ``(n + m) R * 2 < n m``
  (torch's ``min_compression_rate`` 2); vectors and small matrices travel uncompressed. The
  first :func:`start_iter` steps run plain AllReduce (torch needs at least 2: DDP rebuilds its
  buckets after the first step). Its error-feedback buffer is as large as the gradients.

Compression changes the numbers, an accuracy trade hpar never makes unasked: ``off`` (the
default) is the program without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("off", "fp16", "bf16", "powersgd")
DEFAULT_RANK = 2  # torch's docs: "typically only a small value 1-4 is used"
MIN_COMPRESSION_RATE = 2  # torch's PowerSGDState default: compress only where it saves 2x or more
FLAG = "--compress"


@dataclass(frozen=True)
class Compression:
    """One ``--compress`` value: ``kind`` (one of :data:`KINDS`) and, for ``powersgd``, the
    matrix approximation ``rank`` (0 otherwise)."""

    kind: str = "off"
    rank: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{FLAG} {self.kind!r}: choose one of off, fp16, bf16, powersgd[:RANK]")
        if self.kind == "powersgd" and self.rank < 1:
            raise ValueError(f"{FLAG} powersgd:{self.rank}: the rank must be at least 1 (1-4 is typical)")
        if self.kind != "powersgd" and self.rank:
            raise ValueError(f"{FLAG} {self.kind}:{self.rank}: only powersgd takes a rank")

    @property
    def on(self) -> bool:
        """Whether gradients are compressed at all."""
        return self.kind != "off"

    def __str__(self) -> str:
        return f"powersgd:{self.rank}" if self.kind == "powersgd" else self.kind

    @classmethod
    def parse(cls, text: str) -> "Compression":
        """``off``, ``fp16``, ``bf16``, ``powersgd`` (rank :data:`DEFAULT_RANK`) or
        ``powersgd:R``; ValueError naming the flag otherwise."""
        kind, _, rank = str(text).strip().lower().partition(":")
        if kind == "powersgd" and not rank:
            return cls("powersgd", DEFAULT_RANK)
        if rank and not rank.isdigit():
            raise ValueError(f"{FLAG} {text}: the rank is a whole number, e.g. powersgd:2")
        return cls(kind, int(rank) if rank else 0)

    @classmethod
    def of(cls, value) -> "Compression":
        """A Compression from itself, its text (:meth:`parse`), a dict (config.json) or None (off)."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if isinstance(value, dict):
            return cls(**value)
        return cls.parse(value)


def start_iter(steps: int) -> int:
    """PowerSGD's ``start_powerSGD_iter`` for a run of ``steps`` optimizer steps: 10% of the
    steps (torch's advice), at least 2 (what DDP's bucket rebuild after step 1 needs)."""
    return max(2, steps // 10)


def wire_elements(shape: tuple[int, ...], c: Compression) -> tuple[float, int]:
    """What one gradient of ``shape`` puts on the wire per AllReduce under ``c``:
    (elements, bytes per element). fp32 uncompressed: (numel, 4); fp16/bf16: (numel, 2);
    powersgd: ``(n + m) * R`` for a matrix it compresses (``n = shape[0]``, ``m`` the rest,
    ``R = min(n, m, rank)``), else numel, at 4 bytes."""
    numel = math.prod(shape) if shape else 1
    if c.kind in ("fp16", "bf16"):
        return float(numel), 2
    if c.kind != "powersgd" or len(shape) < 2:
        return float(numel), 4
    n = shape[0]
    m = numel // n if n else 0
    r = min(n, m, c.rank)
    small = (n + m) * r
    return (float(small) if small * MIN_COMPRESSION_RATE < n * m else float(numel)), 4


def compressed_bytes(shapes: list[tuple[int, ...]], c: Compression) -> float:
    """Bytes of the dense gradients of ``shapes`` on the wire in one AllReduce under ``c``
    (before the ring's 2(N-1)/N)."""
    return sum(n * size for n, size in (wire_elements(s, c) for s in shapes))


def powersgd_buffers(shapes: list[tuple[int, ...]], c: Compression) -> tuple[float, float]:
    """PowerSGD's extra bytes on each worker for gradients of ``shapes`` (fp32): (the
    error-feedback buffer, as large as the gradients; the warm-started P and Q factors,
    ``(n + m) R`` per compressed matrix). (0, 0) for another kind."""
    if c.kind != "powersgd":
        return 0.0, 0.0
    error = 4.0 * sum(math.prod(s) if s else 1 for s in shapes)
    factors = 4.0 * sum(wire_elements(s, c)[0] for s in shapes if len(s) >= 2 and wire_elements(s, c)[0] < math.prod(s))
    return error, factors


def powersgd_flops(shapes: list[tuple[int, ...]], c: Compression) -> float:
    """Floating-point operations of one PowerSGD step on the gradients of ``shapes``: per
    compressed n x m matrix, P = M Q and Q = M^T P (2 n m R each), M' = P Q^T (2 n m R) and
    two Gram-Schmidt orthogonalisations (about 2 n R^2 + 2 m R^2): a roofline estimate, the
    matmuls dominate (Vogels et al., Algorithm 1)."""
    if c.kind != "powersgd":
        return 0.0
    total = 0.0
    for s in shapes:
        if len(s) < 2:
            continue
        n = s[0]
        m = math.prod(s) // n if n else 0
        r = min(n, m, c.rank)
        if (n + m) * r * MIN_COMPRESSION_RATE < n * m:
            total += 6.0 * n * m * r + 2.0 * (n + m) * r * r
    return total


def compression_work(shapes: list[tuple[int, ...]], c: Compression) -> float:
    """The estimated work of compressing gradients of ``shapes`` under ``c``, in no unit: what
    scales a measured time from some tensors to others (PowerSGD's :func:`powersgd_flops` plus
    the elements every setting touches)."""
    return powersgd_flops(shapes, c) + sum(math.prod(s) if s else 1 for s in shapes)


__all__ = [
    "Compression",
    "compression_work",
    "KINDS",
    "DEFAULT_RANK",
    "FLAG",
    "start_iter",
    "wire_elements",
    "compressed_bytes",
    "powersgd_buffers",
    "powersgd_flops",
]
