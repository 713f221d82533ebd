"""Cost model of ``hybrid`` with the workers' hot-row caches (``hybrid-cache``: ``hpar run
--staleness s [--cache-rows N]``, strategies/runtimes/hybrid/cache.py, after HET: Miao et al., "HET:
Scaling out Huge Embedding Model Training via Cache-enabled Distributed Framework", VLDB 2022).

Per served embedding table, the profile's row frequencies (ParamProfile.hot_rows, counted over
``hot_rows.HOT_BATCHES`` batches) give the hit rate of a cache of its N hottest rows and the
shares of hybrid's pulled and pushed rows that still cross the network
(strategies/profile/hot_rows.cache_shares); the step is then hybrid's (costmodel_ps.py) with
those shares of the pulls and pushes, their link time, the servers' work on them, and each
table's placement decided again with them. The cache costs no request: its freshness bits ride
on the answers to pulls a worker sends anyway (ceil(N / 8) bytes per table and step at most,
left out here). Staleness changes what the model learns, not only how fast: the planner offers
this candidate only when the user asked for it with ``--staleness``.
"""

from __future__ import annotations

from hpar.strategies.specs.base import ON_SERVERS
from hpar.strategies.specs.servers_spec import HYBRID, HYBRID_CACHE
from hpar.strategies.specs.servers_spec import REFRESH_STEPS, CacheConfig
from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.costmodel import Estimate
from hpar.strategies.profile.hot_rows import HotRows, cache_shares
from hpar.strategies.profile.records import Profile

NAME = HYBRID_CACHE.name
SHOWN_STALENESS = 4  # the staleness `hpar profile` shows the cache at when --staleness is not given


def cache_prediction(
    hot: dict[str, HotRows], table_rows: dict[str, int], cache: CacheConfig, workers: int
) -> dict[str, dict]:
    """Per table with row frequencies ``hot`` (name: hot_rows.HotRows; ``table_rows`` its rows):
    ``{"rows": the cache's capacity, "hit_rate", "pulled", "pushed": shares of hybrid's rows,
    "looked_up": a batch's distinct rows}``."""
    out = {}
    for name, h in hot.items():
        rows = cache.rows_for(table_rows[name])
        hit, pulled, pushed = cache_shares(h, rows, cache.staleness, workers, REFRESH_STEPS)
        out[name] = {
            "rows": rows,
            "hit_rate": hit,
            "pulled": pulled,
            "pushed": pushed,
            "looked_up": h.touches / h.batches if h.batches else 0.0,
        }
    return out


def hit_rate(prediction: dict[str, dict], served: set[str]) -> float:
    """The predicted share of the served tables' looked-up rows read from the caches (each
    table weighted by the distinct rows a batch looks up in it)."""
    tables = [d for n, d in prediction.items() if n in served]
    total = sum(d["looked_up"] for d in tables)
    return sum(d["hit_rate"] * d["looked_up"] for d in tables) / total if total else 0.0


def profiled(profile: Profile) -> tuple[dict[str, HotRows], dict[str, int]]:
    """The profile's row frequencies of its embedding tables, and their row counts."""
    hot = {p.name: p.hot() for p in profile.params if p.embedding_module and p.hot() is not None}
    return hot, {p.name: p.rows for p in profile.params if p.name in hot}


def estimate_hybrid_cache(profile: Profile, cluster: ClusterSpec, cache: CacheConfig) -> Estimate:
    """``hybrid-cache``: hybrid's estimate with the cached tables' pulls and pushes scaled by
    their predicted shares (see the module docstring); ``breakdown`` adds the predicted
    ``hit_rate``. Infeasible, with a note, where no embedding's rows were profiled or the
    servers cannot run the optimizer."""
    from hpar.strategies.plan.costmodel_ps import _ps_estimate, _server_refusal

    refused = _server_refusal(profile, HYBRID.name)
    if refused is not None:
        return Estimate(NAME, 0.0, 0, 0.0, feasible=False, note=refused.note)
    pred = cache_prediction(*profiled(profile), cache, cluster.workers)
    if not pred:
        return Estimate(NAME, 0.0, 0, 0.0, feasible=False, note="no embedding table's row frequencies were profiled")
    est = _ps_estimate(
        profile, cluster, HYBRID.name, shares={n: (d["pulled"], d["pushed"]) for n, d in pred.items()}, name=NAME
    )
    served = {n for n, where in est.placement.items() if where == ON_SERVERS}
    sizes = {p.name: p for p in profile.params}
    held = cache_bytes(
        {n: d["rows"] for n, d in pred.items() if n in served},
        {n: sizes[n].bytes / max(sizes[n].rows, 1) for n in pred},
    )
    return Estimate(
        est.strategy,
        est.step_s,
        est.samples_per_step,
        est.bytes_per_step,
        {**est.breakdown, "hit_rate": hit_rate(pred, served), "cache_bytes": held},
        placement=est.placement,
        partitions=est.partitions,
    )


def cache_bytes(rows: dict[str, int], row_bytes: dict[str, float]) -> float:
    """Bytes a worker's caches hold (the memory model's ``cache`` term, strategies/plan/memory_model.py):
    per table of ``rows[name]`` cached rows of ``row_bytes[name]`` bytes, the copies and the
    gradients held back (2 rows each) plus an id, a readable step and a count of held updates (8 bytes each)."""
    return sum(n * (2 * row_bytes[name] + 24) for name, n in rows.items())


def plan_cache(
    hot: dict[str, HotRows], table_rows: dict[str, int], cache: CacheConfig, workers: int, served: set[str]
) -> dict:
    """The ``cache`` entry of a plan that runs the caches: the flags' values, the predicted hit
    rate and, per served table, its first epoch's rows (the hottest of ``hot``)."""
    pred = cache_prediction({n: h for n, h in hot.items() if n in served}, table_rows, cache, workers)
    return {
        "staleness": cache.staleness,
        "rows": cache.rows,
        "predicted_hit_rate": hit_rate(pred, served),
        "hot_rows": {n: list(hot[n].ids[: d["rows"]]) for n, d in pred.items()},
    }
