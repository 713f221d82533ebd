"""Cost model of TorchRec's shardings (``torchrec``, ``torchrec-tw``, ``-rw``, ``-cw``): the
all-to-alls of each embedding table's ids, looked-up rows and their gradients, the DDP
AllReduce of the dense rest, and the profiled compute (notation and message model in
strategies/plan/costmodel.py; the bytes of each sharding in docs/strategies.md, "torchrec").

Sources: Ivchenko et al., "TorchRec", RecSys 2022; torchrec.distributed's ``tw_sharding``,
``rw_sharding``, ``cw_sharding``. hpar swaps every table for a one-table EmbeddingBagCollection
(strategies/runtimes/torchrec/trec_tables.py), so an nn.Embedding's ids become bags of one id.
Per table, from the ids I and bags O of one worker's batch (``ParamProfile.lookups`` / ``bags``):
table-wise sends ids to the table's owner and pooled rows back (the owner's link the busiest);
row-wise pools partial sums everywhere and reduce-scatters them (twice the bytes on gloo, whose
reduce-scatter moves an AllReduce's), then all-gathers the gradients; column-wise sends the ids
to every column shard (a table too narrow to cut stays whole, moving as a table-wise one). Each
table is its own collection, so its collectives run one table after another: a phase takes
the busiest link's bytes over its bandwidth, plus ``A2A_PER_STEP`` collectives' fixed time
(``ClusterSpec.allgather_fixed_s``). Table-wise places each table on the least-loaded worker,
largest traffic first (as TorchRec's greedy partitioner does). The step: data + the ids' and
rows' all-to-alls + forward + backward with the dense AllReduce under it + the gradients'
all-to-all + the fused update of the busiest worker's touched rows + the dense update.
``torchrec`` (the planner's choice) is predicted as the cheapest of the three fixed shardings,
not by mimicking TorchRec's own planner."""

from __future__ import annotations

from dataclasses import dataclass

from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.costmodel import INDEX_BYTES, CostSetting, Estimate, cost_setting, split_tail
from hpar.strategies.profile.records import ParamProfile, Profile
from hpar.strategies.specs.base import ON_ALLREDUCE
from hpar.strategies.specs.torchrec_spec import COLUMN_MULTIPLE, column_shards
from hpar.strategies.specs.torchrec_spec import SHARDINGS, TORCHREC, TORCHREC_CW, TORCHREC_RW, TORCHREC_TW

LENGTH_BYTES = 8  # one int64 bag length per bag in the KeyedJaggedTensor
# gloo's reduce-scatter moves as many bytes as an AllReduce of the whole buffer: a row-wise
# recsys.py over 2 emulated hosts sent 1.39-1.46x the bytes counted with a plain reduce-scatter
# on the hosts' TCP sockets (table-wise 1.03x), the extra one more copy of the pooled rows
GLOO_REDUCE_SCATTER = 2.0
SPARSE_ROUND_COLLECTIVES = 3  # gloo's sparse AllReduce: AllGathers of the sizes, the ids, the rows
A2A_PER_STEP = 5  # per table: splits, lengths, ids forward (KJTAllToAll); pooled rows; their gradients


@dataclass(frozen=True)
class TableTraffic:
    """One table's per-worker figures: ``ids`` bytes of its batch's ids and bag lengths,
    ``rows`` bytes of the pooled rows it gets back, ``update`` bytes of the rows the N
    workers' batches touch (the fused update's work), ``shards`` the column shards TorchRec
    would cut it into under column-wise (torchrec_spec.column_shards; 1: kept whole)."""

    name: str
    ids: float
    rows: float
    update: float
    shards: int = 1


def table_traffic(p: ParamProfile, n: int, samples: int) -> TableTraffic:
    """:class:`TableTraffic` of table ``p`` over ``n`` workers. Unmeasured lookups (an older
    profile: ``lookups`` 0) are taken as unpooled, a row back per id, at least one id per sample
    and the touched rows (what the profile knows): never cheaper than the rows it touches."""
    dim = p.shape[1] if len(p.shape) > 1 else 1
    elem = p.bytes / max(p.rows * dim, 1)
    ids = p.lookups or max(float(samples), p.alpha * p.rows)
    bags = p.bags or ids
    return TableTraffic(
        p.name,
        ids * INDEX_BYTES + bags * LENGTH_BYTES,
        bags * dim * elem,
        p.union_for(n) * p.bytes,
        column_shards(dim, n),
    )


@dataclass
class Phase:
    """Bytes each rank sends and receives in one all-to-all phase."""

    sent: list
    recv: list


def _owners(tables: list[TableTraffic], n: int) -> list[int]:
    """Table-wise: each table's owner, the least-loaded rank, largest traffic first (as TorchRec's
    greedy partitioner places tables by its own costs)."""
    load, owner = [0.0] * n, [0] * len(tables)
    for i in sorted(range(len(tables)), key=lambda i: -(tables[i].ids + 2 * tables[i].rows)):
        owner[i] = min(range(n), key=lambda r: (load[r], r))
        load[owner[i]] += tables[i].ids + 2 * tables[i].rows
    return owner


def table_phases(t: TableTraffic, sharding: str, n: int, owner: int = 0, gloo: bool = True) -> tuple[dict, list]:
    """({"ids", "rows", "grads"}: Phase, fused-update bytes per rank) of table ``t`` under
    ``sharding`` on ``n`` ranks, ``owner`` its rank when table-wise (module docstring). ``gloo``
    (CPU workers): a row-wise table's reduce-scatter moves twice its bytes, as an AllReduce of
    the partial sums would (:data:`GLOO_REDUCE_SCATTER`). A column-wise table TorchRec keeps
    whole (``t.shards`` 1: too narrow to cut) moves as a table-wise one on ``owner``; one cut
    into S shards sends each worker's ids to the S shards' owners."""
    ph = {k: Phase([0.0] * n, [0.0] * n) for k in ("ids", "rows", "grads")}
    if sharding == "table_wise" or (sharding == "column_wise" and t.shards <= 1):
        update = [t.update if r == owner else 0.0 for r in range(n)]
        for r in range(n):
            if r != owner:
                ph["ids"].sent[r] += t.ids
                ph["rows"].recv[r] += t.rows
                ph["grads"].sent[r] += t.rows
        ph["ids"].recv[owner] += (n - 1) * t.ids
        ph["rows"].sent[owner] += (n - 1) * t.rows
        ph["grads"].recv[owner] += (n - 1) * t.rows
        return ph, update
    ids = (n - 1) / n * t.ids * (1 if sharding == "row_wise" else t.shards)
    rows = (n - 1) * t.rows if sharding == "row_wise" else (n - 1) / n * t.rows
    forward = rows * (GLOO_REDUCE_SCATTER if sharding == "row_wise" and gloo else 1.0)
    for r in range(n):
        for k, b in (("ids", ids), ("rows", forward), ("grads", rows)):
            ph[k].sent[r] += b
            ph[k].recv[r] += b
    return ph, [t.update / n] * n


def phase_seconds(phase: Phase, c: CostSetting) -> float:
    """Seconds of one all-to-all phase, bytes only: the busiest link. Among one host's ranks
    each rank's own bytes at the intra-host bandwidth; between hosts each host's share bound
    off-host, (N-G)/(N-1) of its ranks' bytes, at the link's bandwidth."""
    n, g = c.n, c.g
    if n <= 1:
        return 0.0
    busiest = [max(s, v) for s, v in zip(phase.sent, phase.recv)]
    if c.h <= 1:
        return max(busiest) / c.intra_bw
    off = (n - g) / (n - 1)
    hosts = [(sum(phase.sent[h * g : (h + 1) * g]), sum(phase.recv[h * g : (h + 1) * g])) for h in range(c.h)]
    between = max(max(s, v) for s, v in hosts) * off / c.p2p_bw
    return max(between, max(busiest) * (1 - off) / c.intra_bw)


def collectives_fixed_s(c: CostSetting, sharding: str) -> float:
    """Seconds one table's collectives take per step bytes aside: ``A2A_PER_STEP`` of them, a
    row-wise table's pooled rows by a reduce-scatter forward and an all-gather backward instead
    of two all-to-alls. Each is N-1 latencies, or what a small gloo collective was measured to
    take: among one host's CPU workers the one of its kind (an all-to-all taken as a small
    AllGather's, ``ClusterSpec.allgather_fixed_s``); between hosts a third of a one-row sparse
    AllReduce over them (``ClusterSpec.sparse_round_s``: gloo runs it as three AllGathers, of
    the sizes, the ids and the rows; over emulated hosts it took 5.3 ms where the link's
    latency is 0.1 ms: its TCP rounds and threads' wake-ups, not the wire)."""
    if c.n <= 1:
        return 0.0
    lat = (c.n - 1) * c.lat
    if c.allgather_fixed is not None:  # one host: a small gloo AllGather among its CPU workers, measured
        a2a = c.allgather_fixed
    elif c.sparse_round is not None:  # between hosts: a third of a small sparse AllReduce over them, measured
        a2a = c.sparse_round / SPARSE_ROUND_COLLECTIVES
    else:
        a2a = lat
    if sharding != "row_wise":
        return A2A_PER_STEP * a2a
    scatter = c.reduce_scatter_fixed if c.reduce_scatter_fixed is not None else a2a
    return (A2A_PER_STEP - 2) * a2a + scatter + a2a


def sharding_problem(profile: Profile) -> str:
    """Why no TorchRec sharding can run this model ("" when one can): no trainable table, a
    table tied to a dense layer (the swap would untie it), or one whose width is not a multiple
    of 4 columns (trec_tables.table_problem)."""
    if any(p.tied_to and p.sparse for p in profile.params) or any(
        p.tied_to for p in profile.params if p.embedding_module
    ):
        return "an embedding table is tied to a dense layer; TorchRec shards one table per module"
    if not any(p.embedding_module and not p.frozen for p in profile.params):
        return "no trainable nn.Embedding/nn.EmbeddingBag table to shard"
    narrow = [
        p.name for p in profile.trained if p.embedding_module and len(p.shape) > 1 and p.shape[1] % COLUMN_MULTIPLE
    ]
    if narrow:
        return f"{narrow[0]} is not a multiple of {COLUMN_MULTIPLE} columns wide, which FBGEMM's table kernels need"
    return ""


def estimate_sharding(profile: Profile, cluster: ClusterSpec, sharding: str, name: str) -> Estimate:
    """Estimate of every table sharded ``sharding`` (``"table_wise"``, ``"row_wise"``,
    ``"column_wise"``) under strategy ``name`` (module docstring). Infeasible (note says why)
    where :func:`sharding_problem` says so."""
    why = sharding_problem(profile)
    if why:
        return Estimate(name, 0.0, 0, 0.0, feasible=False, note=why)
    c = cost_setting(profile, cluster)
    tables = [table_traffic(p, c.n, profile.samples_per_batch) for p in profile.trained if p.embedding_module]
    dense = [p for p in profile.trained if not p.embedding_module]
    gloo = cluster.device_flops is None and profile.device == "cpu"  # CPU workers: their collectives run on gloo
    owners = _owners(tables, c.n)  # table-wise, and column-wise tables kept whole
    a2a, update, sent = {"ids": 0.0, "rows": 0.0, "grads": 0.0}, [0.0] * c.n, 0.0
    for t, owner in zip(tables, owners):  # one collection per table: its own all-to-alls, one after another
        phases, upd = table_phases(t, sharding, c.n, owner, gloo)
        update = [a + b for a, b in zip(update, upd)]
        for k, v in phases.items():
            a2a[k] += phase_seconds(v, c)
            sent += sum(v.sent) / c.n
    fixed = len(tables) * collectives_fixed_s(c, sharding)
    d_over, d_tail = split_tail(dense)
    ar_over, ar_tail = c.allreduce(sum(p.bytes for p in d_over)), c.allreduce(sum(p.bytes for p in d_tail))
    fused = max(update) * c.update_per_byte
    dense_update = c.update(sum(p.bytes for p in dense), len(dense))
    forward_a2a = a2a["ids"] + a2a["rows"]
    step = (
        c.data
        + c.host
        + forward_a2a
        + c.fwd
        + c.under_backward(ar_over)
        + ar_tail
        + a2a["grads"]
        + fixed
        + fused
        + dense_update
    )
    sent += 2 * (c.n - 1) / c.n * sum(p.bytes for p in dense) if c.n > 1 else 0.0
    return Estimate(
        name,
        step,
        c.n * profile.samples_per_batch,
        sent,
        {
            "data": c.data,
            "host": c.host,
            "all_to_all_ids": a2a["ids"],
            "all_to_all_rows": a2a["rows"],
            "all_to_all_grads": a2a["grads"],
            "all_to_all_fixed": fixed,
            "forward": c.fwd,
            "backward": c.bwd,
            "comm_overlap": ar_over,
            "comm_tail": ar_tail,
            "fused_update": fused,
            "update": dense_update,
        },
        placement={p.name: ON_ALLREDUCE for p in profile.params if not p.embedding_module},
        note=f"every table {sharding.replace('_', '-')}",
    )


def estimate_torchrec_tw(profile: Profile, cluster: ClusterSpec) -> Estimate:
    """``torchrec-tw``: every table whole on one worker (:func:`estimate_sharding`)."""
    return estimate_sharding(profile, cluster, SHARDINGS[TORCHREC_TW.name], TORCHREC_TW.name)


def estimate_torchrec_rw(profile: Profile, cluster: ClusterSpec) -> Estimate:
    """``torchrec-rw``: every table's rows split over the workers (:func:`estimate_sharding`)."""
    return estimate_sharding(profile, cluster, SHARDINGS[TORCHREC_RW.name], TORCHREC_RW.name)


def estimate_torchrec_cw(profile: Profile, cluster: ClusterSpec) -> Estimate:
    """``torchrec-cw``: every table's columns split over the workers (:func:`estimate_sharding`)."""
    return estimate_sharding(profile, cluster, SHARDINGS[TORCHREC_CW.name], TORCHREC_CW.name)


def estimate_torchrec(profile: Profile, cluster: ClusterSpec) -> Estimate:
    """``torchrec`` (TorchRec's planner chooses): predicted as the cheapest of the three fixed
    shardings, named in the note. TorchRec's planner costs with its own figures and may mix
    shardings per table; this is the best it could do among uniform plans."""
    options = [
        estimate_sharding(profile, cluster, s, TORCHREC.name)
        for s in (SHARDINGS[TORCHREC_TW.name], SHARDINGS[TORCHREC_RW.name], SHARDINGS[TORCHREC_CW.name])
    ]
    if not options[0].feasible:
        return options[0]
    best = min(options, key=lambda e: e.step_s)
    return Estimate(
        best.strategy,
        best.step_s,
        best.samples_per_step,
        best.bytes_per_step,
        best.breakdown,
        best.placement,
        note=f"predicted as the cheapest uniform plan: {best.note}",
    )
