"""The memory model's worker terms of ``torchrec`` (strategies/plan/memory_model.py's shape):
each worker holds the dense part whole with its optimizer state and DDP's buckets, and about
1/N of the tables with their fused optimizer state (table- and row-wise shards spread the
tables' bytes over the N workers; the planner balances them); no table gradient exists (the
fused optimizer updates the rows inside backward), only the pooled rows' gradients, which
the measured step term covers."""

from __future__ import annotations

from hpar.strategies.plan.memory_model import _ratio, _step


def torchrec_terms(profile, cluster, est=None, schedule: str = "") -> dict[str, float]:
    """Worker terms of torchrec (module docstring), in bytes."""
    m, r, n = profile.memory, _ratio(profile), max(1, cluster.workers)
    tables = sum(p.bytes for p in profile.params if p.embedding_module)
    dense = profile.total_bytes - tables
    own = tables / n
    return {
        "params": dense + own,
        "optimizer": r * (dense + own),
        "ddp_buckets": dense,
        "step": _step(m, profile, dense, stepped=dense),
        "data": m.data_bytes if m else 0,
    }
