"""Cost model of the parameter-server strategies, ``ps`` and ``hybrid``: placement of each
parameter, partition counts, and the predicted step (notation and the message model in
strategies/plan/costmodel.py).

Per parameter on the servers, with alpha the fraction of rows one worker's batch touches:
a worker pulls ``alpha * rows`` (row, id) pairs and pushes as many gradient rows (hybrid
with servers on other hosts: a host pushes the union of its workers' rows once, Parallax's
local aggregation); a server sums its share of the pushes and updates the touched rows.
Servers are CPU processes, as in Parallax; where they share the cores of CPU workers, their
CPU time (the estimate's ``server_cpu``) and every request's own CPU (``requests``: the
measured CPU of a request's two ends, hpar's client and server included, per request a worker
sends, CostSetting.request_cpu) are CPU work the hosts' cores must fit into a step
(:func:`cpu_bound`): with many small tables on many servers the requests, not their bytes,
set the pace. A worker also deduplicates each served table's ids
on its own thread every step (``lookup``: ParamProfile.dedup_s, measured by the profiler).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.strategies.specs.servers_spec import HYBRID, PS
from hpar.strategies.specs.base import ON_ALLREDUCE, ON_SERVERS
from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.costmodel import (
    CostSetting,
    Estimate,
    cost_setting,
    cpu_share,
    ring_allreduce_s,
    sparse_bytes,
    split_tail,
)
from hpar.strategies.specs.servers_spec import ROW_PARTITIONS_PER_SERVER
from hpar.strategies.profile.records import ParamProfile, Profile

# 1, 2, 4, ... up to the runtime's default for a table without a planned count
PARTITION_FACTORS = tuple(2**k for k in range(ROW_PARTITIONS_PER_SERVER.bit_length()))


def server_imbalance(p: ParamProfile, partitions: int, servers: int) -> float:
    """Load of the busiest server over the mean (>= 1) when p's rows are cut into
    ``partitions`` contiguous ranges placed round-robin on ``servers`` (``ps_shard.RowLayout``),
    from the profiled share of row touches per row bucket (``row_mass``; evenly without it).
    With fewer partitions than servers the busiest server holds a whole partition: at least
    ``servers / partitions``."""
    if servers <= 1:
        return 1.0
    mass = p.row_mass or [1.0] * max(partitions, 1)  # unprofiled: rows touched evenly
    nb = len(mass)
    load = [0.0] * servers
    for part in range(partitions):
        lo, hi = part * nb / partitions, (part + 1) * nb / partitions
        share = 0.0
        for b in range(int(lo), min(nb, math.ceil(hi))):
            share += mass[b] * max(0.0, min(hi, b + 1) - max(lo, b))
        load[part % servers] += share
    total = sum(load)
    return max(load) * servers / total if total > 0 else 1.0


def _ps_link_s(c: CostSetting, per_host_bytes: float, per_server_bytes: float, colocated: bool) -> float:
    """Seconds to move one direction of PS traffic: the busiest of a host's link (its
    workers' bytes) and a server's link (its share of all workers' bytes). A server on a
    worker host (Parallax's one per host) shares that host's full-duplex link, but its bytes
    go the other way (a pull brings rows to the workers and takes them out of the servers; a
    push the reverse), so the two overlap; the (H-1)/H of the traffic that leaves the host
    crosses it. On one host everything goes at ``bw`` (intra-host)."""
    if c.h > 1 and colocated:
        return max(per_host_bytes, per_server_bytes) * (c.h - 1) / c.h / c.p2p_bw
    return max(per_host_bytes, per_server_bytes) / c.p2p_bw


def choose_partitions(
    p: ParamProfile, c: CostSetting, pull_host: float, push_host: float, pull_total: float, push_total: float
) -> tuple[int, float, float]:
    """(partition count, pull seconds, push seconds) of a PS-placed parameter.

    Parallax (Kim et al., EuroSys 2019, section 4.2) models the step time as a function of the
    partition count and picks the minimum instead of trying counts with restarted jobs; here
    t(P) = link time with the busiest server's share scaled by :func:`server_imbalance`
    + per-message overhead 2 * N * lat, the same for every P: a server takes one pull and one
    push of the table from each of the N workers, since hpar's client sends one request per
    server holding rows, all of that server's partitions in it (Parallax's TensorFlow runtime
    sent one per partition, which made many partitions dear; charging that here made the
    planner keep a frequency-sorted vocabulary's head on one server, BENCHMARKS.md 16)
    + the CPU of a worker's requests, one pull and one push to each of the min(P, S) servers
    holding rows (``c.request_cpu``; it decides the count, while the returned times leave it to
    the step's ``requests`` term). P runs over {1, 2, 4, ...} below S (a small table on
    fewer servers: fewer requests, more bytes on the busiest server) and S * {1, 2, 4, ..., 64},
    at most the row count."""
    colocated = c.s <= c.h
    counts = [2**k for k in range(max(c.s - 1, 0).bit_length()) if 2**k < c.s] + [c.s * f for f in PARTITION_FACTORS]
    best = None
    for count in counts:
        parts = min(count, p.rows)
        imb = server_imbalance(p, parts, c.s)
        overhead = c.n * c.lat  # per direction: N requests to each holding server, whatever P
        pull = _ps_link_s(c, pull_host, pull_total * imb / c.s, colocated) + overhead
        push = _ps_link_s(c, push_host, push_total * imb / c.s, colocated) + overhead
        cost = pull + push + 2 * min(parts, c.s) * c.request_cpu  # (the step charges requests apart)
        if best is None or cost < best[0] - 1e-12:
            best = (cost, parts, pull, push)
        if parts == p.rows:
            break
    return best[1:]


@dataclass(frozen=True)
class OnPS:
    """One parameter's costs on the servers, per step: ``pull``/``push`` seconds (a
    worker's wait), ``server`` seconds a server spends summing and updating it, ``traffic``
    bytes a server receives and sends for it, ``sent`` bytes a worker sends for it, and its
    ``partitions`` (sparse parameters only, else None); ``requests`` a worker sends for it per
    step (a pull and a push to every server holding rows of it; a host's pushes once with
    local aggregation)."""

    param: ParamProfile
    partitions: int | None
    pull: float
    push: float
    server: float
    traffic: float
    sent: float
    requests: float = 0.0


def on_ps(p: ParamProfile, c: CostSetting, hybrid: bool, shares: tuple[float, float] = (1.0, 1.0)) -> OnPS:
    """:class:`OnPS` of parameter ``p`` in setting ``c``. Pulls: alpha of the rows (a dense
    parameter: all of it) per worker; pushes: as many per worker, or with local aggregation
    (hybrid, several workers per host, servers on other hosts, as the runtime does it) the
    union of the host's rows once; the server update touches the union over all workers.
    ``shares``: the parts of those pulls and pushes that still cross the network with the
    workers' hot-row caches (strategies/plan/costmodel_cache.py; 1, 1 without)."""
    pulled, pushed = shares
    base = sparse_bytes(p, p.alpha) if p.sparse else p.bytes
    pull_w = base * pulled
    if hybrid and p.sparse and c.h > 1 and c.g > 1:
        push_h = sparse_bytes(p, p.union_for(c.g)) * pushed
    else:
        push_h = c.g * base * pushed
    n_push = push_h * c.h
    parts, t_pull, t_push = choose_partitions(p, c, c.g * pull_w, push_h, c.n * pull_w, n_push)
    touched = (p.union_for(c.n) * p.bytes * pushed) if p.sparse else p.bytes
    holders = min(c.s, parts if p.sparse else c.s, p.rows)  # servers with rows of p (RowLayout)
    aggregated = hybrid and p.sparse and c.h > 1 and c.g > 1
    # every server holding a slice of p steps it: a cost per tensor besides the bytes
    server = ((n_push + touched) * c.server_per_byte + holders * c.server_per_tensor) / c.s
    return OnPS(
        p,
        parts if p.sparse else None,
        t_pull,
        t_push,
        server,
        (c.n * pull_w + n_push) / c.s,
        push_h / c.g,
        holders * (1 + (1 / c.g if aggregated else 1)),
    )


def allreduce_cost(p: ParamProfile, c: CostSetting) -> float:
    """Seconds per step ``p`` costs on AllReduce instead: its ring AllReduce, plus writing
    its dense gradient and updating every row (two passes at the update rate)."""
    return ring_allreduce_s(p.bytes, c.n, c.bw, c.lat) + 2 * p.bytes * c.update_per_byte


def server_busy(terms: list[OnPS], c: CostSetting) -> float:
    """A server's CPU seconds per step: its updates plus copying its traffic through the
    host's kernel (at the intra-host rate)."""
    return sum(t.server + t.traffic / c.intra_bw for t in terms)


def cpu_bound(c: CostSetting, cluster: ClusterSpec, worker_cpu: float, server_cpu: float) -> float:
    """Seconds per step the CPU work of one host's processes takes on its cores
    (``ClusterSpec.cores_per_host``): its ``c.g`` workers' ``worker_cpu`` each (seconds per step
    at their share of the cores, as CostSetting scales them) and its ``c.s / c.h`` servers'
    ``server_cpu`` each, brought back to one core's seconds and divided by the cores. With
    every process on a core of its own this is at most the step; where the hosts' cores are
    fewer than their processes (this project's emulated hosts share 2 vCPUs), it is what the
    step cannot be shorter than."""
    k = cpu_share(cluster)
    return (c.g * worker_cpu + c.s / c.h * server_cpu) / k / cluster.cores_per_host


def _placed(profile: Profile, c: CostSetting, hybrid: bool, shares: dict | None = None) -> list[OnPS]:
    """The parameters on the servers, frozen ones never (they stay on the workers, untouched):
    all the others for ``ps``; for ``hybrid`` each embedding whose PS costs (pull + push + server work) are below :func:`allreduce_cost`; ``shares``
    (name: (pulled, pushed)) as :func:`on_ps` takes them, for the tables with a hot-row cache."""
    terms = []
    for p in profile.params:
        if (hybrid and not p.embedding_module) or p.frozen:  # a frozen parameter stays on the workers
            continue
        t = on_ps(p, c, hybrid, (shares or {}).get(p.name, (1.0, 1.0)))
        if not hybrid or t.pull + t.push + t.server + t.requests * c.request_cpu < allreduce_cost(p, c):
            terms.append(t)
    return terms


def _ps_estimate(
    profile: Profile, cluster: ClusterSpec, strategy: str, shares: dict | None = None, name: str | None = None
) -> Estimate:
    """Shared by ``ps`` and ``hybrid``; see their docstrings. ``shares`` and ``name``: the
    ``hybrid-cache`` estimate's (strategies/plan/costmodel_cache.py).

    Servers and cores: with a spare core for every process (``c.overlap``) a server works
    beside the workers: the updates of tables pushed early run under backward, and only the
    last table's (layer 0's) update is waited for. When a host's servers share cores its
    workers keep busy, the step is the longer of a worker's own path (its CPU work at its share
    of the cores, its waits on the links, and both ends of each request, the measured
    ``request_cpu``: it does its own end, and waits for the server's, since the next pull is
    answered only once the server has taken the step's pushes) and :func:`cpu_bound`, the CPU
    work of a host's processes, its servers' included, over the host's cores."""
    hybrid = strategy_spec(strategy).ddp  # hybrid: the dense part on AllReduce (ps: on the servers too)
    c = cost_setting(profile, cluster, with_servers=True)
    terms = _placed(profile, c, hybrid, shares)
    placed = {t.param.name for t in terms}
    on_ar = [p for p in profile.params if p.name not in placed and not p.frozen]  # frozen: no gradient, no update
    tail = [t for t in terms if t.param.layer == 0]
    over = [t for t in terms if t.param.layer != 0]
    d_over, d_tail = split_tail(on_ar)
    ar_over, ar_tail = c.allreduce(sum(p.bytes for p in d_over)), c.allreduce(sum(p.bytes for p in d_tail))
    push_over, push_tail = sum(t.push for t in over), sum(t.push for t in tail)
    server_over, server_tail = sum(t.server for t in over), sum(t.server for t in tail)
    # (an embedding on AllReduce also writes its dense gradient, as in estimate_allreduce)
    dense_update = c.update(sum(p.bytes * (2 if p.embedding_module else 1) for p in on_ar), len(on_ar))
    pull = sum(t.pull for t in terms)
    busy = server_busy(terms, c)
    # a worker's requests per step: pulls and pushes, and a DONE to every server
    requests = (sum(t.requests for t in terms) + c.s if terms else 0.0) * c.request_cpu
    # the worker deduplicates each served table's ids on its own thread, whatever the cores
    lookup = cpu_share(cluster) * sum(t.param.dedup_s for t in terms if t.partitions is not None)
    if c.overlap:
        step = (
            c.data
            + c.host
            + lookup
            + pull
            + c.fwd
            + max(c.bwd, ar_over + push_over + server_over)
            + ar_tail
            + push_tail
            + max(server_tail, dense_update)
        )
    else:
        # busy cores: the worker's path (its CPU at its share of the cores, the links, both
        # ends of each request) or, where more, the hosts' CPU work over their cores
        own = c.data + c.host + lookup + c.fwd + c.bwd + dense_update
        serial = own + pull + ar_over + push_over + ar_tail + push_tail + requests
        step = max(serial, cpu_bound(c, cluster, own + requests, busy))
    sent = sum(t.sent for t in terms) + (2 * (c.n - 1) / c.n * sum(p.bytes for p in on_ar) if c.n > 1 else 0.0)
    return Estimate(
        name or strategy,
        step,
        c.n * profile.samples_per_batch,
        sent,
        {
            "data": c.data,
            "host": c.host,
            "lookup": lookup,
            "pull": pull,
            "forward": c.fwd,
            "backward": c.bwd,
            "comm_overlap": ar_over + push_over,
            "comm_tail": ar_tail + push_tail,
            "server_update": server_over + server_tail,
            "update": dense_update,
            "server_cpu": busy,
            "requests": requests,
        },
        placement={p.name: (ON_SERVERS if p.name in placed else ON_ALLREDUCE) for p in profile.params},
        partitions={t.param.name: t.partitions for t in terms if t.partitions is not None},
    )


def estimate_ps(profile: Profile, cluster: ClusterSpec) -> Estimate:
    """``ps`` (every parameter on the servers, as TensorFlow's PS): each worker pulls every
    dense parameter and the rows its batch touches, and pushes the same amount of gradients;
    a server aggregates its share of the N pushes and updates (Li et al., "Scaling distributed
    machine learning with the parameter server", OSDI 2014). step = pull + fwd + backward
    (with the pushes of other layers under it) + push of layer 0 + server update of layer 0."""
    return _server_refusal(profile, PS.name) or _ps_estimate(profile, cluster, PS.name)


def estimate_hybrid(profile: Profile, cluster: ClusterSpec) -> Estimate:
    """``hybrid`` (Parallax, Kim et al., EuroSys 2019): each embedding table on the servers,
    row partitioned (:func:`choose_partitions`), unless AllReduce costs it less (a small table
    whose requests cost more than its bytes); everything else by ring AllReduce. The
    AllReduce and the pushes share the link under backward; the server update of the last
    table pushed (layer 0's) overlaps the workers' dense update."""
    return _server_refusal(profile, HYBRID.name) or _ps_estimate(profile, cluster, HYBRID.name)


def _server_refusal(profile: Profile, strategy: str) -> Estimate | None:
    """An infeasible Estimate where the parameter servers cannot apply the user's optimizer
    (``Profile.server_optimizer_note``, one line with the fix), else None."""
    if not profile.server_optimizer_note:
        return None
    return Estimate(strategy, 0.0, 0, 0.0, feasible=False, note=profile.server_optimizer_note)
