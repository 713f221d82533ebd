"""Predicted step time of a pipeline plan of K stages x R replicas (pipeline x data
parallelism), and the choice of (K, R, layout, M). Pure functions of a Profile and a
ClusterSpec, like ``strategies/plan/costmodel.py``, whose notation and helpers it uses.

For every split N = K x R with 2 <= K <= layers (or the user's R), both rank layouts of
strategies/plan/pipeline_grid.py and M in {1, K, 2K, 4K} (each moved to the nearest divisor of
the batch, at least K where the batch has one)::

    step = (M + K - 1) * period + max_k (allreduce_k + update_k) + message

``period`` is the slowest stage's seconds per micro-batch from PipeDream's partition DP
(strategies/plan/partition.py: compute, ``fixed_share + (1 - fixed_share)/M`` of the batch's,
plus its activation out and gradient in, over the intra-host link when every boundary stays
within a host, else the inter-host link shared by the boundaries leaving the busiest host) + 2
messages, slowed on CPU workers by the host's ``cpu_share`` as in the other strategies; (M + K -
1) periods is a synchronous step with a bubble of (K-1)/(M+K-1) (Huang et al., "GPipe", NeurIPS
2019). ``allreduce_k`` is a ring AllReduce of stage k's trainable bytes over its R replicas
(``costmodel.ring_allreduce_s``; across hosts the rings of all stages share each host's link),
run after the step's last backward with the update, no overlap, as replicas.py does it;
``message`` carries the step's loss to rank 0 (:func:`message_s`). Samples per step: R x the
batch. The user's view: docs/strategies.md, "The pipeline candidate".

Sources: PipeDream's planner (Narayanan et al., SOSP 2019, section 3.1: stage replication
and its AllReduce cost), Megatron-LM's pipeline x data parallel placement (Narayanan et al.,
SC 2021, section 3.3), the alpha-beta message cost of ``costmodel``.
"""

from __future__ import annotations

import math

from hpar.strategies.specs.base import ON_ALLREDUCE
from hpar.strategies.specs.pipeline_spec import PIPELINE
from hpar.strategies.plan.partition import partition_stages
from hpar.strategies.plan.schedules import micro_batch_count
from hpar.strategies.plan.pipeline_grid import LAYOUTS, Grid
from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.costmodel import Estimate, cost_setting, cpu_share, ring_allreduce_s
from hpar.strategies.plan.roofline import layer_seconds
from hpar.strategies.profile.records import Profile


def host_of(cluster: ClusterSpec) -> list[int]:
    """Host index of every worker rank: ranks fill the hosts in order (as the launcher places them)."""
    return [h for h, g in enumerate(cluster.gpus_per_host) for _ in range(g)]


def activation_bandwidth(cluster: ClusterSpec, grid: Grid) -> float:
    """Bytes/s of a stage boundary (see the module docstring): intra-host when no boundary of
    any replica crosses hosts, else the inter-host bandwidth over the most boundary sends
    that leave one host in one direction."""
    host = host_of(cluster)
    out_fwd, out_bwd = {}, {}
    for r in range(grid.replicas):
        for k in range(grid.stages - 1):
            a, b = host[grid.rank_of(k, r)], host[grid.rank_of(k + 1, r)]
            if a != b:
                out_fwd[a] = out_fwd.get(a, 0) + 1
                out_bwd[b] = out_bwd.get(b, 0) + 1
    if not out_fwd:
        return cluster.intra_Bps
    return cluster.bandwidth_Bps / max(max(out_fwd.values()), max(out_bwd.values()))


def allreduce_seconds(cluster: ClusterSpec, grid: Grid, stage_bytes: list[float]) -> list[float]:
    """Seconds of each stage's replica AllReduce (see the module docstring)."""
    if grid.replicas == 1:
        return [0.0] * grid.stages
    host = host_of(cluster)
    edges, spans = {}, []
    for k in range(grid.stages):
        ranks = grid.stage_ranks(k)
        crossing = [host[a] for a, b in zip(ranks, ranks[1:] + ranks[:1]) if host[a] != host[b]]
        for h in crossing:
            edges[h] = edges.get(h, 0) + 1
        spans.append(bool(crossing))
    share = max(edges.values()) if edges else 1
    one_host = cluster.allreduce_Bps or cluster.intra_Bps
    return [
        ring_allreduce_s(nbytes, grid.replicas, cluster.bandwidth_Bps / share if span else one_host, cluster.latency_s)
        for nbytes, span in zip(stage_bytes, spans)
    ]


def message_s(c) -> float:
    """Seconds of one small point-to-point message between two stages: the link's latency, or,
    where the fixed time of a small AllReduce among this host's workers was measured
    (``ClusterSpec.allreduce_fixed_s``: wake-ups of gloo's threads on shared cores), one step of
    that ring, which sends 2(N-1) messages one after another (Patarasuk and Yuan, "Bandwidth
    optimal all-reduce algorithms", JPDC 2009). The link probe's latency is the least of a few
    median round trips between two idle endpoints; a stage's message waits for a process that
    shares busy cores, as the ring's do (BENCHMARKS.md, "The cost model against measurement")."""
    if c.allreduce_fixed is not None and c.n > 1:
        return max(c.lat, c.allreduce_fixed / (2 * (c.n - 1)))
    return c.lat


def estimate_grid(profile: Profile, cluster: ClusterSpec, grid: Grid, micro_batches: int) -> Estimate:
    """The synchronous (gpipe/1f1b) Estimate of ``grid`` with ``micro_batches`` micro-batches
    per replica's batch on ``cluster`` (module docstring). The profile must be a sequence of
    at least ``grid.stages`` layers."""
    c = cost_setting(profile, cluster)
    layers, K, R, m = profile.layers, grid.stages, grid.replicas, micro_batches
    if cluster.device is not None:  # a projected device: each layer's roofline time (strategies/plan/roofline.py)
        comp, fixed = layer_seconds(profile, cluster.device), 0.0
        comp[-1] += max(0.0, c.fwd + c.bwd - sum(comp))  # the loss and unattributed time go to the last layer
    else:
        # profiled compute slowed as every strategy's is where the host's workers outnumber its
        # cores, every layer alike (the loss and unattributed time go to the last layer)
        share = cpu_share(cluster)
        comp, fixed = [share * (l.forward_s + l.backward_s) for l in layers], profile.fixed_share
        comp[-1] += max(0.0, share * (profile.forward_s + profile.backward_s) - sum(comp))
    per_micro = fixed + (1.0 - fixed) / m  # a micro-batch's share of the batch's compute
    plan = partition_stages(
        [x * per_micro for x in comp],
        [l.activation_bytes // m for l in layers],
        [l.param_bytes for l in layers],
        K,
        activation_bandwidth(cluster, grid),
    )
    msg = message_s(c)
    period = max(plan.stage_s) + 2 * msg
    # each stage's trainable bytes: its layers' less its frozen parameters (no gradient, no update)
    stage_bytes = [
        max(
            0.0,
            float(
                sum(l.param_bytes for l in layers[a:b])
                - sum(p.bytes for p in profile.params if p.frozen and a <= p.layer < b)
            ),
        )
        for a, b in plan.ranges
    ]
    reduce = allreduce_seconds(cluster, grid, stage_bytes)
    tensors = [sum(1 for p in profile.trained if a <= p.layer < b) for a, b in plan.ranges]
    updates = [c.update(nbytes, count) for nbytes, count in zip(stage_bytes, tensors)]
    tail = max(ar + u for ar, u in zip(reduce, updates))
    # the first stage draws the batch; the last sends the step's loss to rank 0 (one message)
    step = c.data + c.host + (m + K - 1) * period + tail + msg
    acts = (
        sum(
            m
            * (
                (layers[b - 1].activation_bytes // m if b < len(layers) else 0)
                + (layers[a - 1].activation_bytes // m if a > 0 else 0)
            )
            for a, b in plan.ranges
        )
        / K
    )
    reduced = sum(2 * (R - 1) / R * nbytes for nbytes in stage_bytes) / K
    return Estimate(
        PIPELINE.name,
        step,
        R * profile.samples_per_batch,
        acts + reduced,
        {
            "data": c.data,
            "host": c.host,
            "period": period,
            "message": msg,
            "bubble": (K - 1) / (m + K - 1),
            "update": max(updates),
            "allreduce": max(reduce),
            "stages": K,
            "replicas": R,
        },
        placement={p.name: ON_ALLREDUCE for p in profile.params},
        stages=tuple(tuple(r) for r in plan.ranges),
        micro_batches=m,
        replicas=R,
        layout=grid.layout,
    )


def pipeline_grid_estimates(profile: Profile, cluster: ClusterSpec, replicas: int | None = None) -> list[Estimate]:
    """Every synchronous pipeline plan over K x R = N (both layouts, M in {1, K, 2K, 4K}, each
    moved to the nearest divisor of the batch, at least K where the batch has one:
    ``schedules.micro_batch_count``), fastest (highest samples/s) first; ``replicas``: only
    that R (``--pipeline-replicas``). One infeasible Estimate (``note`` says why) when the
    model is not a sequence of layers, N < 2 (without ``replicas``), or no split has at most
    one stage per layer. The planner takes the fastest that fits the memory
    (strategies/plan/pipeline_fit.py)."""
    n, layers = cluster.workers, profile.layers
    if not profile.is_sequential:
        return [Estimate(PIPELINE.name, 0.0, 0, 0.0, feasible=False, note=profile.sequential_reason)]
    if replicas is None and n < 2:
        return [Estimate(PIPELINE.name, 0.0, 0, 0.0, feasible=False, note="a pipeline needs at least 2 workers")]
    if replicas is not None and (replicas < 1 or n % replicas):
        return [
            Estimate(
                PIPELINE.name,
                0.0,
                0,
                0.0,
                feasible=False,
                note=f"--pipeline-replicas {replicas} does not divide the {n} workers",
            )
        ]
    splits = [(n // replicas, replicas)] if replicas else [(k, n // k) for k in range(2, n + 1) if n % k == 0]
    splits = [(k, r) for k, r in splits if k <= len(layers)]
    if not splits:
        return [
            Estimate(
                PIPELINE.name,
                0.0,
                0,
                0.0,
                feasible=False,
                note=f"{len(layers)} layers cannot fill {n // (replicas or 1)} stages",
            )
        ]
    found, batch = [], math.gcd(profile.batch_size, profile.samples_per_batch or profile.batch_size)
    for k, r in splits:
        for layout in LAYOUTS if r > 1 else LAYOUTS[:1]:
            for m in sorted({micro_batch_count(f, batch, min(f, k)) for f in (1, k, 2 * k, 4 * k)}):
                found.append(estimate_grid(profile, cluster, Grid(k, r, layout), m))
    best = found[0]
    for est in found[1:]:  # the first of (nearly) equals in K, layout, M order
        if est.samples_per_s > best.samples_per_s * (1 + 1e-12):
            best = est
    return [best] + sorted((e for e in found if e is not best), key=lambda e: -e.samples_per_s)


def estimate_pipeline_grid(profile: Profile, cluster: ClusterSpec, replicas: int | None = None) -> Estimate:
    """The fastest of :func:`pipeline_grid_estimates` (the first of equals in K, layout, M
    order), or the infeasible Estimate saying why there is none."""
    return pipeline_grid_estimates(profile, cluster, replicas)[0]


def describe(est: Estimate) -> str:
    """One line for the profile table: "K stages x R replicas (layout), M micro-batches,
    layers [a, b) ..." (each stage's layer range)."""
    where = {
        "stages-adjacent": "a pipeline's stages on adjacent ranks",
        "replicas-adjacent": "a stage's replicas on adjacent ranks",
    }.get(est.layout, est.layout)
    micro = f"{est.micro_batches} micro-batch{'es' if est.micro_batches != 1 else ''}"
    split = "layers " + " ".join(f"[{a}, {b})" for a, b in est.stages)
    return (
        f"{len(est.stages)} stages x {est.replicas} replicas ({where}), {micro}, {split}"
        if est.replicas > 1
        else f"{len(est.stages)} stages, {micro}, {split}"
    )
