"""Predicted step time and bytes per worker per step of every strategy, from a Profile and a
ClusterSpec. Pure functions of frozen values: no process, no clock.

Notation: N workers, H hosts, G = most workers on one host, S servers, B bytes, ``bw`` the
link bandwidth (bytes/s) and ``lat`` the per-message latency of :class:`ClusterSpec`.
Messages cost lat + B/bw (Hockney's alpha-beta model, Parallel Computing 1994). A collective
among CPU workers of one host pays, instead of its rounds of latencies, the fixed time a small
one of its kind was measured to take among them (``ClusterSpec.allreduce_fixed_s`` and its
peers, strategies/plan/probe_collectives.py: gloo's threads waking on shared cores).

Compute: the profiled seconds (on the device the profile measured on), or, when the cluster
gives a device (``--device-tflops``, ``--device-mem-gbps``), each layer's roofline time
max(FLOPs / FLOP/s, bytes moved / memory bytes/s) (strategies/plan/roofline.py: memory-bound
layers are no longer free). An optimizer update of B parameter bytes in T tensors costs
``B * profile.update_s_per_byte + T * profile.update_s_per_tensor`` as profiled (torch's CPU
optimizers loop over the tensors in Python; parameter servers: the profile's host figures,
they are CPU processes as in Parallax); on a projected device it is memory bound, 3 bytes
moved per parameter byte (read weight and gradient, write weight) at its memory bandwidth,
and no cost per tensor (a device's optimizers step the tensors fused, ``foreach``).

Overlap (wait-free backpropagation: Zhang et al., "Poseidon", USENIX ATC 2017; Li et al.,
"PyTorch Distributed", VLDB 2020): a gradient is sent as soon as backward produced it, so
communication of every layer but the first runs under the rest of backward, and
``step = data + host + forward + max(backward, overlappable comm) + comm of layer 0's gradients + update``
(``data``: drawing the batch, Profile.data_s; ``host``: the host's own seconds a step on a GPU
beyond its timed kernels, Profile.step_overhead_s, 0 on CPUs);
layer 0's gradients are the last ones backward produces, so their exchange cannot hide.
Pulls from parameter servers happen before forward and do not overlap. Workers computing on
a CPU whose cores they fill (``cpu_share`` >= 1) get no overlap: gloo reduces and copies
on the same cores backward runs on, so ``max`` becomes a sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpar.strategies.specs.allreduce_spec import ALLREDUCE, ALLREDUCE_SPARSE
from hpar.strategies.specs.base import ON_ALLREDUCE
from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.roofline import compute_seconds, update_seconds_per_byte
from hpar.strategies.profile.records import ParamProfile, Profile

INDEX_BYTES = 8  # int64 row id sent with every sparse row
BUCKET_BYTES = 25 << 20  # DDP's default gradient bucket (bucket_cap_mb=25)
GLOO_THREADS = 2  # work threads of a gloo process group (ProcessGroupGloo.Options' default)


@dataclass(frozen=True)
class Estimate:
    """One candidate strategy's prediction. ``step_s`` seconds per synchronous step;
    ``samples_per_step`` over all workers; ``bytes_per_step`` = bytes one worker sends per
    step (mean over workers); ``breakdown`` names the seconds of each part; ``feasible``
    False with ``note`` saying why the strategy cannot run this job."""

    strategy: str
    step_s: float
    samples_per_step: int
    bytes_per_step: float
    breakdown: dict = field(default_factory=dict)
    placement: dict = field(default_factory=dict)
    partitions: dict = field(default_factory=dict)
    stages: tuple = ()
    micro_batches: int = 0
    feasible: bool = True
    note: str = ""
    replicas: int = 1  # pipeline: R replicas of the K = len(stages) stages
    layout: str = ""  # pipeline: rank layout (strategies/runtimes/pipeline/replicas.py)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s if self.feasible and self.step_s > 0 else 0.0


def ring_allreduce_s(nbytes: float, n: int, bw: float, lat: float, fixed_s: float | None = None) -> float:
    """Seconds of a ring AllReduce of ``nbytes`` over ``n`` workers in DDP buckets:
    buckets * 2(n-1) * lat + 2(n-1)/n * nbytes / bw (Patarasuk & Yuan, JPDC 2009; Thakur,
    Rabenseifner & Gropp, IJHPCA 2005); ``fixed_s`` (a small AllReduce's measured time,
    ClusterSpec.allreduce_fixed_s) replaces each bucket's 2(n-1) latencies. 0 for n = 1 or no bytes."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    buckets = max(1, math.ceil(nbytes / BUCKET_BYTES))
    fixed = 2 * (n - 1) * lat if fixed_s is None else fixed_s
    return buckets * fixed + 2 * (n - 1) / n * nbytes / bw


def ring_allgather_s(
    nbytes_each: float, n: int, bw: float, lat: float, rounds: int = 2, fixed_s: float | None = None
) -> float:
    """Seconds of a ring AllGather where each of ``n`` workers contributes ``nbytes_each``:
    rounds * (n-1) * lat + (n-1) * nbytes_each / bw (Thakur et al. 2005). ``rounds`` = 2 for
    a sparse gradient (indices, then values; gloo's sparse allreduce). ``fixed_s`` replaces the
    latency term (0.0: the caller charges a measured fixed time itself, ClusterSpec.sparse_round_s)."""
    if n <= 1 or nbytes_each <= 0:
        return 0.0
    fixed = rounds * (n - 1) * lat if fixed_s is None else fixed_s
    return fixed + (n - 1) * nbytes_each / bw


def sparse_bytes(p: ParamProfile, fraction: float) -> float:
    """Bytes of ``fraction`` of p's rows sent as (row id, row values)."""
    rows = fraction * p.rows
    return rows * (p.bytes / p.rows + INDEX_BYTES)


@dataclass(frozen=True)
class CostSetting:
    """What every estimate needs, from a profile and a cluster: workers ``n``, the most workers
    on one host ``g``, hosts ``h``, servers ``s``; bandwidths in bytes/s, latency and
    compute in seconds per step (forward ``fwd``, backward ``bwd``, scaled to the cluster's
    devices and cores), update costs in seconds per byte; ``request_cpu`` the step time a
    parameter-server request takes where the processes share busy cores: the measured CPU of
    its two ends (``ClusterSpec.request_cpu_s``) times the host's load (``cpu_share``): a host
    pays for its workers' requests and, with the servers spread as the workers are, for as
    many answers; 0 with spare cores (a request then waits for the link: the latency)."""

    n: int
    g: int
    h: int
    s: int
    bw: float  # bandwidth of collectives (AllReduce, AllGather)
    lat: float
    fwd: float
    bwd: float
    update_per_byte: float  # worker update
    server_per_byte: float  # server (CPU) update
    p2p_bw: float  # bandwidth of point-to-point traffic (worker<->server, stage->stage)
    sparse_update_per_byte: float  # worker update per byte of gathered sparse gradient rows
    overlap: bool  # a spare core for every process: communication (and servers) run beside backward
    intra_bw: float  # bandwidth between processes of one host (copies through its kernel)
    gather_bw: float  # bandwidth of a ring AllGather of sparse gradients (ClusterSpec.gather_Bps)
    request_cpu: float = 0.0  # seconds a parameter-server request adds to the step on busy cores
    data: float = 0.0  # seconds a worker draws its batch per step (Profile.data_s, times the host's load)
    sparse_round: float | None = (
        None  # seconds of one sparse gradient's exchange, bytes aside (ClusterSpec.sparse_round_s)
    )
    gradient_exchange: float | None = (
        None  # seconds of this job's whole allreduce-sparse exchange, measured (ClusterSpec.gradient_exchange_s)
    )
    update_per_tensor: float = 0.0  # worker update per parameter tensor stepped (Profile.update_s_per_tensor)
    server_per_tensor: float = 0.0  # server (CPU) update per tensor slice it steps
    allreduce_fixed: float | None = None  # a small AllReduce over the workers, measured (ClusterSpec.allreduce_fixed_s)
    allgather_fixed: float | None = None  # ... AllGather (ClusterSpec.allgather_fixed_s)
    reduce_scatter_fixed: float | None = None  # ... ReduceScatter (ClusterSpec.reduce_scatter_fixed_s)
    host: float = 0.0  # the host's own seconds a step on a GPU beyond the timed parts (Profile.step_overhead_s)

    def allreduce(self, nbytes: float) -> float:
        """Seconds of DDP's bucketed AllReduce of ``nbytes`` over the n workers
        (:func:`ring_allreduce_s`, with the measured fixed time per bucket where there is one)."""
        return ring_allreduce_s(nbytes, self.n, self.bw, self.lat, self.allreduce_fixed)

    def update(self, nbytes: float, tensors: int) -> float:
        """Seconds of a worker's optimizer step over ``tensors`` parameter tensors of
        ``nbytes`` bytes in all: a rate per byte and a cost per tensor, both profiled."""
        return nbytes * self.update_per_byte + tensors * self.update_per_tensor

    def under_backward(self, comm: float) -> float:
        """Seconds of backward plus the communication that runs during it."""
        return max(self.bwd, comm) if self.overlap else self.bwd + comm


def cpu_load(cluster: ClusterSpec, with_servers: bool = False) -> float | None:
    """Processes per core on the busiest host when the workers compute on the hosts' CPUs:
    its workers, plus its parameter servers for hybrid/ps; None for accelerators
    (``device_flops``) or unknown cores."""
    if cluster.device_flops or not cluster.cores_per_host:
        return None
    procs = cluster.max_gpus_per_host + (-(-cluster.servers // cluster.hosts) if with_servers else 0)
    return procs / cluster.cores_per_host


def cpu_share(cluster: ClusterSpec) -> float:
    """How much slower profiled CPU compute runs when a host's workers outnumber its cores:
    max(1, :func:`cpu_load`); 1 for accelerators or unknown cores. (Servers are not in it:
    costmodel_ps adds their CPU time to the step when they share busy cores.)"""
    return max(1.0, cpu_load(cluster) or 0.0)


def cost_setting(profile: Profile, cluster: ClusterSpec, with_servers: bool = False) -> CostSetting:
    """The CostSetting of ``profile`` on ``cluster`` (``with_servers``: the hybrid/ps
    strategies, whose servers take cores on the hosts)."""
    if cluster.device is not None:  # a projected device: roofline of its FLOP/s and memory bandwidth
        fwd, bwd = compute_seconds(profile, cluster.device)
        upd = update_seconds_per_byte(cluster.device)
        per_tensor = 0.0  # a CPU's Python loop over the tensors says nothing of a device's fused (foreach) step
    else:
        fwd, bwd, upd = profile.forward_s, profile.backward_s, profile.update_s_per_byte
        per_tensor = profile.update_s_per_tensor
    # the sparse update (coalesce: a sort, then sparse kernels) is only ever timed on this CPU;
    # projections to a device keep that rate (an assumption, pessimistic for GPUs; BENCHMARKS.md 4)
    sparse_upd = profile.sparse_update_s_per_byte or profile.update_s_per_byte
    k, load = cpu_share(cluster), cpu_load(cluster, with_servers)
    p2p = cluster.bandwidth_Bps if cluster.hosts > 1 else cluster.intra_Bps
    busy_cores = load is not None and load >= 1.0
    # on busy cores a request's CPU (both ends, measured) is taken from the host's share of them
    request = k * cluster.request_cpu_s if busy_cores and cluster.request_cpu_s else 0.0
    return CostSetting(
        cluster.workers,
        cluster.max_gpus_per_host,
        cluster.hosts,
        cluster.servers,
        cluster.collective_Bps,
        cluster.latency_s,
        k * fwd,
        k * bwd,
        k * upd,
        k * (profile.host_update_s_per_byte or profile.update_s_per_byte),  # servers: the host's rate
        p2p,
        k * sparse_upd,
        not busy_cores,
        cluster.intra_Bps,
        cluster.gather_Bps,
        request,
        k * profile.data_s,
        cluster.sparse_round_s,
        cluster.gradient_exchange_s,
        k * per_tensor,
        k
        * (
            profile.host_update_s_per_tensor
            if profile.host_update_s_per_tensor is not None
            else profile.update_s_per_tensor
        ),
        *(
            (cluster.allreduce_fixed_s, cluster.allgather_fixed_s, cluster.reduce_scatter_fixed_s)
            if cluster.hosts == 1
            else (None, None, None)
        ),
        profile.step_overhead_s or 0.0,
    )


def split_tail(params, first_layer: int = 0):
    """(overlappable params, tail params): the tail is layer 0's, produced last by backward."""
    return [p for p in params if p.layer != first_layer], [p for p in params if p.layer == first_layer]


def estimate_allreduce(profile: Profile, cluster: ClusterSpec) -> Estimate:
    """``allreduce`` (DDP, every gradient dense, embeddings too): each worker sends
    2(N-1)/N * total bytes per step; step = fwd + max(bwd, AR(other layers)) + AR(layer 0)
    + dense gradient materialisation of embedding tables + update of all parameters. Frozen
    parameters (``ParamProfile.frozen``) are left out: DDP's reducer buckets only parameters
    that require a gradient, and the optimizer steps none without one."""
    c = cost_setting(profile, cluster)
    trained = profile.trained
    over, tail = split_tail(trained)
    ar_over, ar_tail = c.allreduce(sum(p.bytes for p in over)), c.allreduce(sum(p.bytes for p in tail))
    emb = sum(p.bytes for p in trained if p.embedding_module)
    update = c.update(profile.trainable_bytes, len(trained)) + emb * c.update_per_byte
    step = c.data + c.host + c.fwd + c.under_backward(ar_over) + ar_tail + update
    sent = 2 * (c.n - 1) / c.n * profile.trainable_bytes if c.n > 1 else 0.0
    return Estimate(
        ALLREDUCE.name,
        step,
        c.n * profile.samples_per_batch,
        sent,
        {
            "data": c.data,
            "host": c.host,
            "forward": c.fwd,
            "backward": c.bwd,
            "comm_overlap": ar_over,
            "comm_tail": ar_tail,
            "update": update,
        },
        placement={p.name: ON_ALLREDUCE for p in profile.params},
    )


def estimate_allreduce_sparse(profile: Profile, cluster: ClusterSpec) -> Estimate:
    """``allreduce-sparse`` (DDP with sparse embedding gradients, Horovod's default for
    IndexedSlices): dense params by ring AllReduce, each embedding's (ids, rows) by ring
    AllGather: a worker sends (N-1) * alpha * rows * (row bytes + 8), growing with N, at the
    measured AllGather rate between hosts (``ClusterSpec.gather_Bps``) where it was probed.
    Fixed costs: two rounds of N-1 latencies per table, or, where the exchange's fixed time over
    the N workers was probed (``ClusterSpec.sparse_round_s``), that time once per wave of
    ``GLOO_THREADS`` tables, at the end of backward (the exchanges are in flight together,
    which takes less than one after another (BENCHMARKS.md, "The cost model against
    measurement")). Where this job's whole exchange was
    measured at its own sizes (``ClusterSpec.gradient_exchange_s``, ``hpar bench`` on emulated
    hosts: the sparse tables and the dense buckets in flight together, which over a slow link
    took longer than the two apart), that time replaces the AllReduce, the AllGathers and their
    fixed times, at the end of backward.
    Every worker then sums the N gathered gradients and updates the union of touched rows:
    the profiled sparse update (torch's coalesce and sparse kernels) per gathered byte, or,
    unprofiled, a dense-rate sum of the gathered rows and update of their union; where the
    optimizer takes no sparse gradients (Adam, AdamW, ...), a dense-rate sum of the gathered
    rows into a dense table and a dense update of every table (strategies/job/optimizer_rules.py).
    Frozen parameters, tables included, exchange and update nothing (as in :func:`estimate_allreduce`)."""
    c = cost_setting(profile, cluster)
    dense = [p for p in profile.trained if not p.embedding_module]
    sparse = [p for p in profile.trained if p.embedding_module]
    densified = bool(sparse) and not profile.sparse_gradients_ok
    if c.gradient_exchange is not None and c.n > 1 and sparse:  # the whole exchange, dense too, measured
        over, tail = 0.0, c.gradient_exchange
    else:
        d_over, d_tail = split_tail(dense)
        s_over, s_tail = split_tail(sparse)
        probed = c.sparse_round is not None and c.n > 1
        ag = lambda ps: sum(
            ring_allgather_s(sparse_bytes(p, p.alpha), c.n, c.gather_bw, c.lat, fixed_s=0.0 if probed else None)
            for p in ps
        )
        # the step's exchanges are in flight together (DDP launches each as its gradient is ready),
        # run by gloo's GLOO_THREADS work threads: their fixed times overlap in waves of that many
        rounds = math.ceil(len(sparse) / GLOO_THREADS) * c.sparse_round if probed else 0.0
        over = c.allreduce(sum(p.bytes for p in d_over)) + ag(s_over)
        tail = c.allreduce(sum(p.bytes for p in d_tail)) + ag(s_tail) + rounds
    gathered = sum(c.n * p.alpha * p.bytes for p in sparse)
    if densified:  # strategies/job/optimizer_rules.py: the gathered rows summed into a dense table, stepped whole
        merge, sparse_update = gathered * c.update_per_byte, sum(p.bytes for p in sparse) * c.update_per_byte
    elif profile.sparse_update_s_per_byte:
        merge, sparse_update = 0.0, gathered * c.sparse_update_per_byte
    else:
        merge = gathered * c.update_per_byte
        sparse_update = sum(p.union_for(c.n) * p.bytes for p in sparse) * c.update_per_byte
    update = c.update(sum(p.bytes for p in dense), len(profile.trained)) + sparse_update
    step = c.data + c.host + c.fwd + c.under_backward(over) + tail + merge + update
    sent = (2 * (c.n - 1) / c.n * sum(p.bytes for p in dense) if c.n > 1 else 0.0) + sum(
        (c.n - 1) * sparse_bytes(p, p.alpha) for p in sparse
    )
    return Estimate(
        ALLREDUCE_SPARSE.name,
        step,
        c.n * profile.samples_per_batch,
        sent,
        {
            "data": c.data,
            "host": c.host,
            "forward": c.fwd,
            "backward": c.bwd,
            "comm_overlap": over,
            "comm_tail": tail,
            "merge": merge,
            "update": update,
        },
        placement={p.name: ON_ALLREDUCE for p in profile.params},
        note="the optimizer takes no sparse gradients: the gathered rows are made dense to step" if densified else "",
    )
