"""Cost-model formulas and cluster parsing, against hand computations."""

import pytest

from hpar.strategies.plan.cluster import ClusterSpec, make_cluster, parse_bandwidth, parse_latency
from hpar.strategies.plan.costmodel import estimate_allreduce_sparse, ring_allgather_s, ring_allreduce_s, sparse_bytes
from hpar.strategies.plan.costmodel_ps import server_imbalance
from hpar.strategies.profile.profiler import LayerProfile, ParamProfile, Profile


@pytest.mark.parametrize(
    "text,expected",
    [
        ("10Gbps", 1.25e9),
        ("10Gbit", 1.25e9),
        ("1gbit", 1.25e8),
        ("100Mb/s", 1.25e7),
        ("25GB/s", 25e9),
        ("25GBps", 25e9),
        ("1GiB/s", 2**30),
        ("800 Mbit/s", 1e8),
    ],
)
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["10", "fast", "10G", "-1Gbps", "10Xbps", ""])
def test_parse_bandwidth_rejects_and_names_flag(text):
    with pytest.raises(ValueError, match="--bandwidth"):
        parse_bandwidth(text)


@pytest.mark.parametrize("text,expected", [("50us", 5e-5), ("1ms", 1e-3), ("0.2s", 0.2), ("100ns", 1e-7)])
def test_parse_latency(text, expected):
    assert parse_latency(text) == pytest.approx(expected)


def test_parse_latency_rejects():
    with pytest.raises(ValueError, match="--latency"):
        parse_latency("5")


def test_make_cluster_fills_hosts_in_order_and_one_server_per_host():
    c = make_cluster([6] * 8, 48, None, 1e9, 1e-5)
    assert c.hosts == 8 and c.workers == 48 and c.servers == 8 and c.max_gpus_per_host == 6
    c = make_cluster([4, 4, 4], 6, None, 1e9, 1e-5)
    assert c.gpus_per_host == (4, 2) and c.servers == 2
    c = make_cluster(None, 3, None, 1e9, 1e-5)
    assert c.hosts == 1 and c.workers == 3
    with pytest.raises(ValueError, match="--gpus"):
        make_cluster([2, 2], 5, None, 1e9, 1e-5)
    with pytest.raises(ValueError, match="--servers"):
        ClusterSpec(1, (1,), 0, 1e9, 0.0)


def test_ring_allreduce_formula():
    # 2(N-1)/N of the bytes over the link, plus 2(N-1) latencies per 25 MiB bucket
    assert ring_allreduce_s(100e6, 4, 1e9, 1e-4) == pytest.approx(4 * 6 * 1e-4 + 1.5 * 0.1)
    assert ring_allreduce_s(100e6, 1, 1e9, 1e-4) == 0.0


def test_sparse_allgather_grows_with_workers_while_ring_allreduce_does_not():
    per_worker = 1e6
    times = [ring_allgather_s(per_worker, n, 1e9, 0.0) for n in (2, 4, 8, 16)]
    assert times == pytest.approx([(n - 1) * 1e-3 for n in (2, 4, 8, 16)])
    ar = [ring_allreduce_s(1e8, n, 1e9, 0.0) for n in (2, 4, 8, 16)]
    assert max(ar) < 2 * 0.1 + 1e-12


def test_sparse_bytes_counts_row_ids():
    p = ParamProfile("e", (1000, 4), 16_000, True, 0.1, 0.3, True)
    assert sparse_bytes(p, 0.1) == pytest.approx(100 * (16 + 8))


def test_server_imbalance_from_row_mass():
    uniform = ParamProfile("e", (1024, 4), 16384, True, 0.1, 0.3, True, row_mass=tuple([1 / 256] * 256))
    assert server_imbalance(uniform, 4, 4) == pytest.approx(1.0)
    # all touches in the first eighth of the rows (frequent words first): with 4 partitions on
    # 4 servers one server takes everything; with 32 partitions the hot eighth spans 4 of them
    hot = ParamProfile("e", (1024, 4), 16384, True, 0.1, 0.3, True, row_mass=tuple([1 / 32] * 32 + [0.0] * 224))
    assert server_imbalance(hot, 4, 4) == pytest.approx(4.0)
    assert server_imbalance(hot, 32, 4) == pytest.approx(1.0)


def test_allreduce_sparse_estimate_by_hand():
    emb = ParamProfile(
        "emb", (10_000, 100), 4_000_000, True, 0.05, 0.15, True, layer=0, union_curve=((1, 0.05), (4, 0.15))
    )
    lin = ParamProfile("lin", (100, 100), 40_000, False, 1.0, 1.0, False, layer=1)
    prof = Profile(
        (emb, lin),
        (LayerProfile("emb", 0, 0, 0, 1, 4_000_000), LayerProfile("lin", 0, 0, 1, 1, 40_000)),
        8,
        8,
        4,
        False,
        "x",
        0.3,
        0.1,
        0.2,
        10,
        20,
        1e-9,
        8,
    )
    c = ClusterSpec(1, (4,), 1, 1e8, 1e-4)
    e = estimate_allreduce_sparse(prof, c)
    ag = 2 * 3 * 1e-4 + 3 * 500 * 408 / 1e8
    ar = 2 * 3 * 1e-4 + 1.5 * 40_000 / 1e8
    merge = 4 * 0.05 * 4_000_000 * 1e-9
    update = (40_000 + 0.15 * 4_000_000) * 1e-9
    assert e.step_s == pytest.approx(0.1 + max(0.2, ar) + ag + merge + update)
    assert e.bytes_per_step == pytest.approx(1.5 * 40_000 + 3 * 500 * 408)
    assert e.samples_per_step == 32


def test_allreduce_sparse_gathers_at_the_probed_allgather_rate_between_hosts():
    """The sparse AllGather is priced at the AllGather rate probed between two hosts (gloo
    sends and receives it on one connection, slower than the one-way link); the dense
    AllReduce keeps the link's rate, and without a probed figure nothing changes."""
    emb = ParamProfile(
        "emb", (10_000, 100), 4_000_000, True, 0.05, 0.15, True, layer=0, union_curve=((1, 0.05), (4, 0.15))
    )
    lin = ParamProfile("lin", (100, 100), 40_000, False, 1.0, 1.0, False, layer=1)
    prof = Profile(
        (emb, lin),
        (LayerProfile("emb", 0, 0, 0, 1, 4_000_000), LayerProfile("lin", 0, 0, 1, 1, 40_000)),
        8,
        8,
        4,
        False,
        "x",
        0.3,
        0.1,
        0.2,
        10,
        20,
        1e-9,
        8,
    )
    plain = make_cluster([1] * 4, 4, None, 1e8, 1e-4)
    probed = make_cluster([1] * 4, 4, None, 1e8, 1e-4, allgather_Bps=0.5e8)
    assert plain.gather_Bps == 1e8 and probed.gather_Bps == 0.5e8
    assert make_cluster(None, 4, None, 1e8, 1e-4, allreduce_Bps=2e7, allgather_Bps=0.5e8).gather_Bps == 2e7  # one host
    a, b = estimate_allreduce_sparse(prof, plain), estimate_allreduce_sparse(prof, probed)
    assert b.breakdown["comm_tail"] - a.breakdown["comm_tail"] == pytest.approx(3 * 500 * 408 / 1e8)  # twice as long
    assert b.breakdown["comm_overlap"] == pytest.approx(a.breakdown["comm_overlap"])  # the dense ring: the link
    assert b.bytes_per_step == a.bytes_per_step


def test_allreduce_sparse_uses_the_profiled_sparse_update_or_steps_dense():
    import dataclasses

    emb = ParamProfile(
        "emb", (10_000, 100), 4_000_000, True, 0.05, 0.15, True, layer=0, union_curve=((1, 0.05), (4, 0.15))
    )
    lin = ParamProfile("lin", (100, 100), 40_000, False, 1.0, 1.0, False, layer=1)
    prof = Profile(
        (emb, lin),
        (LayerProfile("emb", 0, 0, 0, 1, 4_000_000), LayerProfile("lin", 0, 0, 1, 1, 40_000)),
        8,
        8,
        4,
        False,
        "x",
        0.3,
        0.1,
        0.2,
        10,
        20,
        1e-9,
        8,
        sparse_update_s_per_byte=5e-9,
    )
    c = ClusterSpec(1, (4,), 1, 1e8, 1e-4)
    e = estimate_allreduce_sparse(prof, c)
    ag = 2 * 3 * 1e-4 + 3 * 500 * 408 / 1e8
    ar = 2 * 3 * 1e-4 + 1.5 * 40_000 / 1e8
    update = 40_000 * 1e-9 + 4 * 0.05 * 4_000_000 * 5e-9  # dense rate + the 4 gathered pushes at the sparse rate
    assert e.breakdown["merge"] == 0.0 and e.breakdown["update"] == pytest.approx(update)
    assert e.step_s == pytest.approx(0.1 + max(0.2, ar) + ag + update)
    no = estimate_allreduce_sparse(
        dataclasses.replace(prof, sparse_update_s_per_byte=None, sparse_gradients_ok=False), c
    )
    dense_step = 4 * 0.05 * 4_000_000 * 1e-9 + (4_000_000 + 40_000) * 1e-9  # gathered rows summed, every row stepped
    assert no.feasible and "made dense to step" in no.note  # strategies/job/optimizer_rules.py
    assert no.breakdown["merge"] + no.breakdown["update"] == pytest.approx(dense_step)
    # a measured exchange time (ClusterSpec.sparse_round_s) replaces the two rounds of N-1 latencies
    probed = estimate_allreduce_sparse(prof, dataclasses.replace(c, sparse_round_s=0.036))
    assert probed.step_s == pytest.approx(0.1 + max(0.2, ar) + ag - 2 * 3 * 1e-4 + 0.036 + update)
    # three tables: their exchanges are in flight together, two at a time (gloo's work threads)
    three = dataclasses.replace(
        prof, params=(emb, dataclasses.replace(emb, name="e2"), dataclasses.replace(emb, name="e3"), lin)
    )
    fixed = [
        estimate_allreduce_sparse(three, dataclasses.replace(c, sparse_round_s=r)).breakdown["comm_tail"]
        for r in (0.0, 0.036)
    ]
    assert fixed[1] - fixed[0] == pytest.approx(2 * 0.036)
    # the job's whole exchange measured at its sizes (ClusterSpec.gradient_exchange_s, hpar bench on
    # emulated hosts: tables and dense buckets in flight together) replaces the AllReduce, the
    # AllGathers and their fixed times, at the end of backward
    exchanged = estimate_allreduce_sparse(prof, dataclasses.replace(c, sparse_round_s=0.036, gradient_exchange_s=0.5))
    assert exchanged.step_s == pytest.approx(0.1 + 0.2 + 0.5 + update)
    assert exchanged.breakdown["comm_tail"] == pytest.approx(0.5) and exchanged.breakdown["comm_overlap"] == 0.0
    assert exchanged.bytes_per_step == e.bytes_per_step
    assert (
        estimate_allreduce_sparse(
            prof, dataclasses.replace(c, hosts=1, gpus_per_host=(1,), gradient_exchange_s=0.5)
        ).step_s
        == estimate_allreduce_sparse(prof, dataclasses.replace(c, hosts=1, gpus_per_host=(1,))).step_s
    )  # one worker: nothing exchanged


def test_single_host_collectives_use_the_measured_allreduce_bandwidth_and_ps_traffic_the_link():
    from hpar.strategies.plan.costmodel import estimate_allreduce
    from hpar.strategies.plan.costmodel_ps import estimate_hybrid

    lin = ParamProfile("lin", (1000, 1000), 4_000_000, False, 1.0, 1.0, False, layer=1)
    emb = ParamProfile(
        "emb", (10_000, 100), 4_000_000, True, 0.05, 0.1, True, layer=0, union_curve=((1, 0.05), (2, 0.1))
    )
    prof = Profile(
        (emb, lin),
        (LayerProfile("emb", 0, 0, 0, 1, emb.bytes), LayerProfile("lin", 0, 0, 1, 1, lin.bytes)),
        8,
        8,
        2,
        False,
        "x",
        0.0,
        0.0,
        0.0,
        1,
        1,
        0.0,
        8,
    )
    one = ClusterSpec(1, (2,), 1, 1e9, 0.0, allreduce_Bps=2e8)
    two = ClusterSpec(2, (1, 1), 1, 1e9, 0.0, allreduce_Bps=2e8)
    assert one.collective_Bps == 2e8 and two.collective_Bps == 1e9
    # ring AllReduce of every byte, N = 2: 2(N-1)/N * 8 MB over the measured AllReduce figure
    assert estimate_allreduce(prof, one).step_s == pytest.approx(8_000_000 / 2e8)
    h = estimate_hybrid(prof, one)
    assert h.breakdown["comm_overlap"] == pytest.approx(4_000_000 / 2e8)  # the dense layer's AllReduce
    # the pull of the touched rows crosses the point-to-point link, not the AllReduce figure
    assert h.breakdown["pull"] == pytest.approx(2 * 500 * 408 / 1e9)


def test_measured_collective_times_replace_the_latencies_on_one_host_only():
    """ClusterSpec.allreduce_fixed_s (and its AllGather and ReduceScatter peers, measured among
    this host's workers by strategies/plan/probe_collectives.py) is each DDP bucket's fixed time
    and each FSDP unit's collectives'; a cluster of several hosts keeps the N - 1 latencies."""
    import dataclasses
    from hpar.strategies.plan.costmodel import estimate_allreduce
    from hpar.strategies.plan.costmodel_fsdp import estimate_fsdp

    assert ring_allreduce_s(100e6, 4, 1e9, 1e-4, fixed_s=0.01) == pytest.approx(4 * 0.01 + 1.5 * 0.1)
    lin = ParamProfile("lin", (1000, 1000), 4_000_000, False, 1.0, 1.0, False, layer=1)
    head = ParamProfile("head", (1000, 10), 40_000, False, 1.0, 1.0, False, layer=2)
    prof = Profile(
        (lin, head),
        (LayerProfile("lin", 0, 0, 1, 1, lin.bytes), LayerProfile("head", 0, 0, 1, 1, head.bytes)),
        8,
        8,
        2,
        False,
        "cpu",
        0.0,
        0.0,
        0.0,
        1,
        1,
        0.0,
        8,
    )
    one = ClusterSpec(1, (2,), 1, 1e9, 0.0, allreduce_Bps=2e8)
    fixed = dataclasses.replace(one, allreduce_fixed_s=0.002, allgather_fixed_s=0.001, reduce_scatter_fixed_s=0.003)
    # one bucket (layers 1 and 2, under backward; layer 0 has no parameter here): 2 ms more
    assert estimate_allreduce(prof, fixed).step_s == pytest.approx(estimate_allreduce(prof, one).step_s + 0.002)
    # FSDP, 2 units: two AllGathers and a ReduceScatter each per step, no latency before
    extra = estimate_fsdp(prof, fixed).step_s - estimate_fsdp(prof, one).step_s
    assert extra == pytest.approx(2 * (2 * 0.001 + 0.003))
    two = ClusterSpec(2, (1, 1), 1, 1e9, 0.0)
    assert estimate_allreduce(prof, dataclasses.replace(two, allreduce_fixed_s=0.5)).step_s == pytest.approx(
        estimate_allreduce(prof, two).step_s
    )


def test_hybrid_places_each_embedding_where_it_costs_less():
    from hpar.strategies.plan.costmodel_ps import allreduce_cost, estimate_hybrid, on_ps
    from hpar.strategies.plan.costmodel import cost_setting

    big = ParamProfile(
        "big.weight", (100_000, 64), 25_600_000, True, 0.01, 0.02, True, layer=0, union_curve=((1, 0.01), (2, 0.02))
    )
    small = ParamProfile(
        "bias.weight", (1000, 1), 4000, True, 0.5, 0.75, True, layer=2, union_curve=((1, 0.5), (2, 0.75))
    )
    lin = ParamProfile("lin.weight", (100, 100), 40_000, False, 1.0, 1.0, False, layer=1)
    prof = Profile(
        (big, lin, small),
        (
            LayerProfile("big", 0, 0, 0, 1, big.bytes),
            LayerProfile("lin", 0, 0, 1, 1, lin.bytes),
            LayerProfile("bias", 0, 0, 0, 1, small.bytes),
        ),
        8,
        8,
        2,
        False,
        "x",
        0.0,
        0.0,
        0.0,
        1,
        1,
        1e-10,
        8,
    )
    c = ClusterSpec(2, (1, 1), 2, 1e9, 1e-3)
    setting = cost_setting(prof, c)
    # the small table: AllReduce = 2(N-1) latencies + its bytes + two passes of updates;
    # on the servers each direction costs N * lat of requests alone
    assert allreduce_cost(small, setting) == pytest.approx(2e-3 + 4000 / 1e9 + 2 * 4000 * 1e-10)
    t = on_ps(small, setting, hybrid=True)
    assert t.pull + t.push >= 2 * 2 * 1e-3
    e = estimate_hybrid(prof, c)
    assert e.placement == {"big.weight": "ps", "lin.weight": "allreduce", "bias.weight": "allreduce"}
    assert set(e.partitions) == {"big.weight"}
    assert e.breakdown["update"] == pytest.approx((40_000 + 2 * 4000) * 1e-10)


def test_link_probe_latency_is_the_least_of_three_rounds(monkeypatch):
    """strategies/plan/probe.py: the small round trips run in three rounds across the probe; a
    round held up by other work on the cores (a one-off 2 ms reading against 0.07 ms) does not
    set the latency."""
    from hpar.strategies.plan import probe

    class Done:
        def wait(self):
            return True

    class FakeGroup:
        def allreduce(self, tensors):
            return Done()

    rounds = iter([[9.0, 9.0] + [4e-3] * 10, [1.0] * 5, [9.0, 9.0] + [1.4e-4] * 10, [9.0, 9.0] + [3e-3] * 10])
    monkeypatch.setattr(probe, "_exchange", lambda pg, rank, out, back, n: next(rounds))
    out = {}
    probe._endpoint(FakeGroup(), 0, 4096, 12, 4, out)
    assert "error0" not in out, out
    figures = probe._figures(out, 4096)
    assert figures.latency_s == pytest.approx(0.7e-4)  # half the quiet round's median
    assert figures.bandwidth_Bps == pytest.approx(4096 / (1.0 - 1.4e-4))
