"""Gradient sparsity of embedding tables, for :mod:`hpar.strategies.profile.profiler`.

The rows an ``nn.Embedding`` / ``nn.EmbeddingBag`` batch touches are the unique ids fed to
the module, read by a forward pre-hook, so no backward is needed. The union over workers
decides the parameter-server traffic of the hybrid strategy (Kim et al., "Parallax",
EuroSys 2019: pull and push the touched rows only).
"""

from __future__ import annotations

import statistics
import time

import torch
from hpar.strategies.job.context import batch_samples

from hpar.strategies.job.contract import Job
from hpar.strategies.job.forward import call_model
from torch import nn

ROW_BUCKETS = 256  # resolution of ParamProfile.row_mass


def _bags(module: nn.Module, args: tuple) -> int:
    """Rows ``module``'s forward on ``args`` returns: an nn.EmbeddingBag's bags (a 2-D input's
    rows, else its offsets, less the last with ``include_last_offset``), an nn.Embedding's ids."""
    ids = args[0]
    if not isinstance(module, nn.EmbeddingBag):
        return ids.numel()
    if ids.dim() == 2 or len(args) < 2 or args[1] is None:
        return ids.shape[0] if ids.dim() == 2 else 1
    return args[1].numel() - (1 if module.include_last_offset else 0)


class _StopForward(Exception):
    """Raised from a hook to end a forward pass once every embedding has seen its ids."""


def embedding_sparsity(
    job: Job, model: nn.Module, embs, batch_size: int, workers: int, max_workers: int, stop_early: bool
) -> dict:
    """Row-touch statistics of every embedding module in ``embs`` (``[(name, module)]``)
    over the first batch of each of min(N, max_workers) workers (N = ``workers``).

    Returns ``{"<name>.weight": {"alpha", "union", "curve", "mass"}}`` plus the samples per
    batch under ``"__samples__"``: ``alpha`` is the mean fraction of rows one worker's batch
    touches, ``curve`` ((k, fraction touched by the union of k workers' batches), ...) up to
    N, extrapolated beyond ``max_workers`` with independent per-row touch probabilities
    (union(n) = mean_r 1 - (1 - p_r)^n, shifted to meet the last measured point), ``union``
    its last value, ``mass`` the share of touches per contiguous row bucket (ROW_BUCKETS),
    ``dedup_s`` the median seconds to deduplicate one batch's ids on the host (what a worker
    does per step for a table on the parameter servers, strategies/profile/sparsity.dedup),
    ``lookups``/``bags`` the mean ids one worker's batch feeds the module and rows it returns
    (:func:`_bags`; every call in a forward counted).
    ``stop_early`` ends each forward once every module has seen its ids (valid when each is
    called once per forward). Raises JobError from the user's data() or forward."""
    R = min(workers, max_workers)
    names = [f"{n}.weight" if n else "weight" for n, _ in embs]
    counts = {n: torch.zeros(m.weight.shape[0], dtype=torch.int32) for n, (_, m) in zip(names, embs)}
    per_worker = {n: [] for n in names}
    curve_at = sorted({k for k in (2**i for i in range(31)) if k <= R} | {R})
    curves = {n: [] for n in names}
    seen: set = set()
    samples = 0
    dedup_s = {n: [] for n in names}
    lookups = {n: [] for n in names}  # per worker: (ids looked up, rows returned)
    looked: dict = {}

    def hook(module, args):
        name = names[[m for _, m in embs].index(module)]
        if name not in seen:  # what a served table's lookup does first on a worker: dedup its ids on the host
            t0 = time.perf_counter()
            dedup(args[0].detach().to("cpu", torch.int64))
            dedup_s[name].append(time.perf_counter() - t0)
        looked[name] = looked.get(name, (0, 0))
        looked[name] = (looked[name][0] + args[0].numel(), looked[name][1] + _bags(module, args))
        ids = args[0].reshape(-1).unique().to("cpu")  # the counts live on the host, whatever the device
        hit = torch.zeros(module.weight.shape[0], dtype=torch.bool)
        hit[ids] = True
        cur[name] |= hit
        seen.add(name)
        if stop_early and len(seen) == len(names):
            raise _StopForward

    handles = [m.register_forward_pre_hook(hook) for _, m in embs]
    try:
        for rank in range(R):
            inputs, _ = next(job.batches(rank, workers, batch_size))
            samples = samples or batch_samples(inputs)
            if not embs:
                break
            cur = {n: torch.zeros(counts[n].shape[0], dtype=torch.bool) for n in names}
            looked = {}
            seen.clear()
            with torch.no_grad():
                try:
                    call_model(model, inputs)
                except _StopForward:
                    pass
            for n in names:
                lookups[n].append(looked.get(n, (0, 0)))
                counts[n] += cur[n].int()
                per_worker[n].append(float(cur[n].float().mean()))
                if rank + 1 in curve_at:
                    curves[n].append((rank + 1, float((counts[n] > 0).float().mean())))
    finally:
        for h in handles:
            h.remove()
    out = {"__samples__": samples}
    for n in names:
        curve = curves[n]
        if workers > R:  # extrapolate with independent per-row probabilities
            p = counts[n].double() / R
            est = lambda k, p=p: float((1 - (1 - p) ** k).mean())
            shift = curve[-1][1] - est(R)
            extra = sorted({k for k in (2**i for i in range(31)) if R < k < workers} | {workers})
            curve = curve + [(k, min(1.0, est(k) + shift)) for k in extra]
        c = counts[n].double()
        buckets = min(ROW_BUCKETS, c.numel())
        edges = torch.arange(buckets + 1) * c.numel() // buckets
        mass = torch.stack([c[edges[i] : edges[i + 1]].sum() for i in range(buckets)])
        mass = mass / mass.sum().clamp_min(1)
        out[n] = {
            "alpha": sum(per_worker[n]) / len(per_worker[n]),
            "union": curve[-1][1],
            "curve": tuple(curve),
            "mass": tuple(round(float(x), 6) for x in mass),
            "dedup_s": statistics.median(dedup_s[n]) if dedup_s[n] else 0.0,
            "lookups": statistics.fmean(i for i, _ in lookups[n]) if lookups[n] else 0.0,
            "bags": statistics.fmean(b for _, b in lookups[n]) if lookups[n] else 0.0,
        }
    return out


def dedup(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique sorted ids, inverse)`` of an int64 id tensor of any shape; ``inverse`` has
    the input's shape and indexes into the unique ids."""
    uids, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    return uids, inverse
