"""Optimizer update costs for the profile: the user's optimizer timed on probe parameters.

Two figures, on the profiled device (one CPU thread, as hpar's CPU workers and servers run,
or a GPU, timed with a synchronize around each step):

* ``dense_update_cost``: seconds per parameter byte of one ``opt.step()`` on a dense probe as
  large as the model's parameters (clamped to [4 MiB, 64 MiB]): a probe that fits the caches
  runs faster per byte than a model-sized one does (BENCHMARKS.md, "The cost model against
  measurement"), and every real update
  streams the whole model.
* ``per_tensor_update_cost``: seconds one ``opt.step()`` spends per parameter tensor beside
  its bytes: torch's CPU optimizers loop over the tensors in Python (``foreach`` is the default
  on CUDA only), so a model of many small tensors steps far slower than a flat probe of its
  bytes says (BENCHMARKS.md, "The cost model against measurement").
* ``sparse_update_cost``: seconds per byte of gathered gradient rows of one ``opt.step()`` on
  a row-sparse gradient (``torch.sparse_coo_tensor``), shaped as DDP with ``sparse=True``
  embeddings hands it over: N workers' (ids, rows) concatenated, uncoalesced, so the
  optimizer's own coalesce is timed too. torch's sparse kernels (coalesce, sparse_mask) cost
  several times the dense per-byte figure, which is why ``allreduce-sparse`` needs its own
  number. None when the optimizer takes no sparse gradient (``strategies/job/optimizer_rules.py``:
  e.g. ``torch.optim.Adam``; ``allreduce-sparse`` then makes the gathered rows dense to step).

And :func:`server_optimizer_problem`: whether the parameter servers of ``hybrid`` and ``ps``
can apply the optimizer at all (strategies/runtimes/hybrid/shard.py).
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
from hpar.strategies.job.contract import Job, JobError
from hpar.strategies.job.optimizer_rules import takes_sparse_gradients
from torch import nn

MIN_PROBE_BYTES = 4 << 20
MAX_PROBE_BYTES = 64 << 20
MAX_PROBE_ROWS = 1 << 16


def probe_optimizer(job: Job, params: list[nn.Parameter]):
    """The user's optimizer over ``params`` (lr 1e-3), plain SGD where ``optimizer()`` fails on
    a bare list: what every probe of the profile steps."""
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
    for _ in range(repeats + 1):  # the first step creates the optimizer state
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
    return _median_step_s(probe_optimizer(job, [p]), repeats, device) / (numel * 4)


PROBE_TENSORS = 64  # tensors of the per-tensor probe (16 floats each)


def per_tensor_update_cost(job: Job, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Seconds per parameter tensor of one step of the user's optimizer (plain SGD if
    ``optimizer()`` fails on a bare parameter list), beside the per-byte cost: the step over
    PROBE_TENSORS tensors of 16 floats less the step over one, over PROBE_TENSORS - 1; at least
    0. Takes a few milliseconds."""
    device = torch.device(device)

    def step_s(count: int) -> float:
        params = [nn.Parameter(torch.randn(16, device=device)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn(16, device=device)
        return _median_step_s(probe_optimizer(job, params), repeats, device)

    return max(0.0, (step_s(PROBE_TENSORS) - step_s(1)) / (PROBE_TENSORS - 1))


def sparse_update_cost(
    job: Job,
    rows: int,
    dim: int,
    alpha: float,
    workers: int,
    repeats: int = 3,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> float | None:
    """Seconds per byte of gathered gradient rows (``workers`` x ``alpha`` x rows x dim x 4)
    of the user's optimizer stepping a ``(rows, dim)`` float32 table (rows capped at
    MAX_PROBE_ROWS, alpha kept) whose gradient is ``workers`` uncoalesced sparse pushes of
    ``alpha * rows`` random rows each. None when the optimizer takes no sparse gradient
    (``optimizer_rules.takes_sparse_gradients``)."""
    rows = max(1, min(int(rows), MAX_PROBE_ROWS))
    touched = max(1, round(alpha * rows))
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    ids = torch.cat([torch.randperm(rows, generator=gen)[:touched] for _ in range(max(1, workers))]).to(device)
    values = torch.randn(ids.numel(), dim, generator=gen).to(device)
    p = nn.Parameter(torch.zeros(rows, dim, device=device))
    opt = probe_optimizer(job, [p])
    if not takes_sparse_gradients(opt, p):
        return None

    def step():
        with warnings.catch_warnings():  # torch warns about skipped sparse invariant checks (some versions)
            warnings.simplefilter("ignore", UserWarning)
            p.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), values, (rows, dim), check_invariants=False)
            opt.step()

    try:
        step()
    except (RuntimeError, NotImplementedError):  # not at this size or on this device after all
        return None
    times = []
    for _ in range(repeats):
        t0 = _now(device)
        step()
        times.append(_now(device) - t0)
    return statistics.median(times) / (ids.numel() * dim * 4)


def server_optimizer_problem(job: Job, model: nn.Module) -> str:
    """Why the parameter servers cannot apply the user's optimizer over ``model``'s parameters
    (each param group's rule, ``hybrid.shard.spec_from_group``: SGD, Adagrad, Adam and AdamW
    without amsgrad or maximize), as one line with the fix; "" when they can, or when
    ``optimizer()`` fails on the model's parameters (the pre-start check reports that)."""
    from hpar.strategies.job.optimizer_rules import spec_from_group

    try:
        opt = job.build_optimizer(list(model.parameters()), lr=1e-3)
    except JobError:
        return ""
    for group in opt.param_groups:
        try:
            spec_from_group(opt, group)
        except ValueError as exc:
            return str(exc)
    return ""
