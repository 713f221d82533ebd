"""Optimizer update costs for the profile: the user's optimizer timed on probe parameters.

Two figures, on the profiled device (one CPU thread, as hpar's CPU workers and servers run,
or a GPU, timed with a synchronize around each step):

* ``dense_update_cost``: seconds per parameter byte of one ``opt.step()`` on a dense probe as
  large as the model's parameters (clamped to [4 MiB, 64 MiB]): a probe that fits the caches
  runs 1.5-2x faster per byte than a model-sized one does (Adagrad here: 0.67 ns/byte at
  4 MiB, 1.26 at 64 MiB), and every real update streams the whole model.
* ``sparse_update_cost``: one ``opt.step()`` on a row-sparse gradient
  (``torch.sparse_coo_tensor``), shaped as DDP with ``sparse=True`` embeddings hands it over:
  N workers' (ids, rows) concatenated, uncoalesced, so the optimizer's own coalesce is timed
  too. It is a fixed time per table plus a time per gathered byte, fitted from two sizes (N
  workers' pushes and four times as many): torch's sparse kernels (coalesce, sparse_mask) cost
  several times the dense per-byte figure, and each table's step also has a fixed part
  (Adagrad here: about 0.3 ms a table on one thread, then about 3 ns a byte), which decides the
  update of a batch's few hundred rows. None when the optimizer rejects sparse gradients (e.g.
  ``torch.optim.Adam``).
"""
from __future__ import annotations

import statistics
import time
import warnings
from typing import NamedTuple

import torch
from hpar.strategies.job import Job, JobError
from torch import nn

MIN_PROBE_BYTES = 4 << 20
MAX_PROBE_BYTES = 64 << 20
MAX_PROBE_ROWS = 1 << 16
SPARSE_FIT_FACTOR = 4   # the second size of the sparse fit: this many times the N workers' pushes


class SparseUpdateCost(NamedTuple):
    """A sparse optimizer step on one table: ``fixed_s`` seconds whatever its rows, plus
    ``s_per_byte`` seconds per byte of gathered gradient rows."""

    fixed_s: float
    s_per_byte: float


def _optimizer(job: Job, params: list[nn.Parameter]):
    try:
        return job.build_optimizer(params, lr=1e-3)
    except JobError:
        return torch.optim.SGD(params, lr=1e-3)


def _now(device: torch.device) -> float:
    """The host clock after ``device`` finished its queued work (synchronize around a timed
    region on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _median_step_s(opt, repeats: int, device: torch.device = torch.device("cpu")) -> float:
    times = []
    for _ in range(repeats + 1):    # the first step creates the optimizer state
        t0 = _now(device)
        opt.step()
        times.append(_now(device) - t0)
    return statistics.median(times[1:])


def dense_update_cost(job: Job, model_bytes: int, repeats: int = 3, device: torch.device | str = "cpu") -> float:
    """Seconds per parameter byte of the user's optimizer (plain SGD if ``optimizer()``
    fails on a bare parameter list) stepping a float32 probe of ``model_bytes`` clamped to
    [MIN_PROBE_BYTES, MAX_PROBE_BYTES] on ``device``. Takes up to about half a second."""
    device = torch.device(device)
    numel = max(MIN_PROBE_BYTES, min(int(model_bytes), MAX_PROBE_BYTES)) // 4
    p = nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn(numel, device=device)
    return _median_step_s(_optimizer(job, [p]), repeats, device) / (numel * 4)


def sparse_update_cost(job: Job, rows: int, dim: int, alpha: float, workers: int,
                       repeats: int = 5, seed: int = 0, device: torch.device | str = "cpu") -> SparseUpdateCost | None:
    """The user's optimizer stepping a ``(rows, dim)`` float32 table (rows capped at
    MAX_PROBE_ROWS, alpha kept) whose gradient is ``workers`` uncoalesced sparse pushes of
    ``alpha * rows`` random rows each, and then SPARSE_FIT_FACTOR times as many: the line
    through the two medians (of ``repeats`` steps each) gives a :class:`SparseUpdateCost`, its
    fixed part the step's time at zero bytes (>= 0; where noise makes the larger gradient no
    slower, all of the smaller one's time is charged per byte). Seconds and seconds per byte
    of gathered gradient rows (``workers * alpha * rows * dim * 4``). None when the optimizer
    raises on a sparse gradient (it cannot run ``allreduce-sparse``)."""
    rows = max(1, min(int(rows), MAX_PROBE_ROWS))
    touched = max(1, round(alpha * rows))
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    p = nn.Parameter(torch.zeros(rows, dim, device=device))
    opt = _optimizer(job, [p])

    def timed(pushes: int) -> tuple[float, int]:
        ids = torch.cat([torch.randperm(rows, generator=gen)[:touched] for _ in range(pushes)]).to(device)
        values = torch.randn(ids.numel(), dim, generator=gen).to(device)
        times = []
        for _ in range(repeats + 1):    # the first step creates the optimizer state
            with warnings.catch_warnings():   # torch warns about skipped sparse invariant checks (some versions)
                warnings.simplefilter("ignore", UserWarning)
                p.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), values, (rows, dim), check_invariants=False)
                t0 = _now(device)
                opt.step()
                times.append(_now(device) - t0)
        return statistics.median(times[1:]), ids.numel() * dim * 4
    try:
        small_s, small_b = timed(max(1, workers))
    except (RuntimeError, NotImplementedError):
        return None
    large_s, large_b = timed(SPARSE_FIT_FACTOR * max(1, workers))
    per_byte = (large_s - small_s) / (large_b - small_b)
    if per_byte <= 0 or per_byte * small_b >= small_s:
        return SparseUpdateCost(0.0, small_s / small_b)
    return SparseUpdateCost(small_s - per_byte * small_b, per_byte)
