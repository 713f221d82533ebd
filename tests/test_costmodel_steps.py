"""Cost models of a step on busy cores and per strategy, against hand computations: the workers' path
against the hosts' CPU work, requests' CPU, how finely served tables are cut, the batch draw and
frozen parameters."""

import pytest

from hpar.strategies.plan.cluster import ClusterSpec, make_cluster
from hpar.strategies.plan.costmodel import estimate_allreduce_sparse
from hpar.strategies.plan.costmodel_ps import server_imbalance
from hpar.strategies.profile.profiler import LayerProfile, ParamProfile, Profile


def _emb_and_dense(workers: int, sequential: bool = False, dedup_s: float = 0.0) -> Profile:
    """A profile of two layers: a 10,000 x 64 embedding (layer 0; a batch touches 5% of its
    rows, 2 workers' batches 10%; ``dedup_s`` its ids' dedup) and a 64 x 64 dense weight (layer
    1); 30 ms forward and 40 ms backward per batch of 32, updates at 1e-10 s per byte."""
    emb = ParamProfile(
        "emb.weight",
        (10_000, 64),
        2_560_000,
        True,
        0.05,
        0.1,
        True,
        layer=0,
        union_curve=((1, 0.05), (2, 0.1)),
        dedup_s=dedup_s,
    )
    lin = ParamProfile("out.weight", (64, 64), 16_384, False, 1.0, 1.0, False, layer=1)
    return Profile(
        params=(emb, lin),
        layers=(
            LayerProfile("emb", 0.01, 0.01, 0, 10, emb.bytes),
            LayerProfile("out", 0.02, 0.03, 10**6, 10, lin.bytes),
        ),
        batch_size=32,
        samples_per_batch=32,
        workers=workers,
        is_sequential=sequential,
        sequential_reason="" if sequential else "x",
        compute_s=0.07,
        forward_s=0.03,
        backward_s=0.04,
        forward_flops=10**6,
        backward_flops=2 * 10**6,
        update_s_per_byte=1e-10,
        timing_batch_size=32,
    )


def test_on_busy_cores_the_step_is_a_workers_path_or_the_hosts_cpu_work_over_their_cores():
    from hpar.strategies.plan.costmodel import cpu_load, cpu_share, estimate_allreduce_sparse
    from hpar.strategies.plan.costmodel_ps import estimate_hybrid

    prof = _emb_and_dense(workers=2)
    shared = ClusterSpec(hosts=1, gpus_per_host=(2,), servers=1, bandwidth_Bps=1e9, latency_s=0.0, cores_per_host=2)
    own = ClusterSpec(hosts=1, gpus_per_host=(2,), servers=1, bandwidth_Bps=1e9, latency_s=0.0)
    # 2 workers on 2 cores: compute runs at full speed, but no core is left for the server
    assert cpu_share(shared) == 1.0 and cpu_load(shared, with_servers=True) == 1.5
    assert (
        cpu_share(
            ClusterSpec(hosts=1, gpus_per_host=(4,), servers=1, bandwidth_Bps=1e9, latency_s=0.0, cores_per_host=2)
        )
        == 2.0
    )
    assert (
        cpu_load(
            ClusterSpec(
                hosts=1,
                gpus_per_host=(4,),
                servers=1,
                bandwidth_Bps=1e9,
                latency_s=0.0,
                cores_per_host=2,
                device_flops=1e12,
            )
        )
        is None
    )  # accelerators
    # per step: pull 5% of the rows to each of 2 workers (row 256 B + 8 B id), receive both
    # workers' pushes (no local aggregation on one host), update the union (10% of the rows)
    pull_w = 500 * 264
    link = 2 * pull_w / 1e9  # each direction, the server's share of the link
    server = (2 * pull_w + 0.1 * 2_560_000) * 1e-10
    busy = server + 4 * pull_w / 1e9  # + copying its traffic through the kernel
    ar, dense = 16_384 / 1e9, 16_384 * 1e-10  # the dense layer's AllReduce and update
    h_shared, h_own = estimate_hybrid(prof, shared), estimate_hybrid(prof, own)
    assert h_shared.breakdown["server_cpu"] == pytest.approx(busy)
    assert h_shared.breakdown["forward"] == pytest.approx(0.03)
    # busy cores: the worker's path (compute, pull, AllReduce and push on the link, update),
    # since the host's CPU work, 2 workers' and the server's, fits its 2 cores in less
    serial = link + 0.03 + 0.04 + ar + link + dense
    assert (2 * (0.07 + dense) + busy) / 2 < serial
    assert h_shared.step_s == pytest.approx(serial)
    # 2 workers and their server on half a core (emulated hosts): compute runs at 1/4 speed,
    # and the requests' CPU (0.2 ms, 0.8 at a quarter of a core) is charged
    crowded = ClusterSpec(
        hosts=1, gpus_per_host=(2,), servers=1, bandwidth_Bps=1e9, latency_s=0.0, cores_per_host=0.5, request_cpu_s=2e-4
    )
    h = estimate_hybrid(prof, crowded)
    assert h.placement["emb.weight"] == "ps"
    worker = 4 * (0.03 + 0.04) + h.breakdown["update"]
    requests = h.breakdown["requests"]
    assert requests == pytest.approx((2 + 1) * 4 * 2e-4)  # a pull, a push and a DONE, at 4x
    links = h.breakdown["pull"] + h.breakdown["comm_overlap"] + h.breakdown["comm_tail"]
    # the longer of the worker's path (both ends of its requests) and the host's CPU work
    cpu = (2 * (worker + requests) + h.breakdown["server_cpu"]) / 4 / 0.5
    assert h.step_s == pytest.approx(max(worker + links + requests, cpu))
    assert h.step_s > worker + links + requests / 2
    # a core for the server: the embedding's update (last pushed) is waited for, beside the dense update
    assert h_own.step_s == pytest.approx(link + 0.03 + max(0.04, ar) + link + max(server, dense))
    # 2 workers on 2 cores: compute is not slowed, but the exchange no longer hides under backward
    s_shared, s_own = estimate_allreduce_sparse(prof, shared), estimate_allreduce_sparse(prof, own)
    bwd, over = s_own.breakdown["backward"], s_own.breakdown["comm_overlap"]
    assert s_shared.breakdown["backward"] == pytest.approx(bwd)
    assert s_shared.step_s == pytest.approx(s_own.step_s - max(bwd, over) + bwd + over)
    assert s_shared.step_s > s_own.step_s


def test_requests_cost_their_measured_cpu_on_busy_cores_only():
    """ClusterSpec.request_cpu_s (strategies/plan/probe.probe_requests): on busy cores every
    request a worker sends (a pull and a push per server holding rows of a table, a DONE per
    server) takes its two ends' CPU times the host's load; with spare cores, or unmeasured,
    nothing is charged; a table whose requests cost more than its AllReduce goes to AllReduce."""
    from dataclasses import replace
    from hpar.strategies.plan.costmodel_ps import estimate_hybrid, estimate_ps

    prof = _emb_and_dense(workers=4)
    # 4 emulated hosts of one worker on 2 cores: load 2 (cpu_share), busy cores
    busy = make_cluster([1] * 4, 4, None, 1e7, 1e-4, cores_per_host=0.5)
    measured = replace(busy, request_cpu_s=2e-4)
    base, charged = estimate_hybrid(prof, busy), estimate_hybrid(prof, measured)
    assert base.breakdown["requests"] == 0.0 and base.placement["emb.weight"] == "ps"
    parts = charged.partitions["emb.weight"]
    per_worker = 2 * min(4, parts) + 4  # a pull and a push to each holder, a DONE to each server
    requests = charged.breakdown["requests"]
    assert requests == pytest.approx(per_worker * 2 * 2e-4)
    # both ends of its requests on the worker's path (it waits for the server's end) and in
    # the hosts' CPU work
    b = charged.breakdown
    own = b["data"] + b["lookup"] + b["forward"] + b["backward"] + b["update"]
    path = own + b["pull"] + b["comm_overlap"] + b["comm_tail"]
    assert base.step_s == pytest.approx(max(path, own + b["server_cpu"]))
    assert charged.step_s == pytest.approx(max(path + requests, own + requests + b["server_cpu"]))
    assert charged.step_s > base.step_s
    # ps: the dense weight is on the servers too, one more table's pulls and pushes
    assert estimate_ps(prof, measured).breakdown["requests"] == pytest.approx((per_worker + 2 * 4) * 2 * 2e-4)
    # spare cores: a request waits for the link (latency), its CPU runs beside the others
    spare = make_cluster([1] * 4, 4, None, 1e7, 1e-4, cores_per_host=8.0, request_cpu_s=2e-4)
    assert estimate_hybrid(prof, spare).breakdown["requests"] == 0.0
    # requests dearer than the table's own AllReduce, even on one server: the table goes to AllReduce
    assert estimate_hybrid(prof, replace(busy, request_cpu_s=0.5)).placement["emb.weight"] == "allreduce"


def test_small_tables_go_to_fewer_servers_when_requests_cost_cpu():
    """choose_partitions tries fewer partitions than servers: a small table's bytes fit one
    server's link, so where each request costs CPU (busy cores, measured request_cpu_s) it is
    kept on fewer servers (fewer requests per worker); a large table stays spread; without a
    request cost the busiest server's share (S/P at best with P < S) keeps one partition per server at least."""
    from dataclasses import replace
    from hpar.strategies.plan.costmodel_ps import estimate_hybrid

    small = ParamProfile(
        "cat.weight", (1_000, 16), 64_000, True, 0.15, 0.5, True, layer=0, union_curve=((1, 0.15), (8, 0.5))
    )
    big = ParamProfile(
        "user.weight", (1_000_000, 64), 256_000_000, True, 0.2, 0.8, True, layer=0, union_curve=((1, 0.2), (8, 0.8))
    )
    lin = ParamProfile("out.weight", (64, 64), 16_384, False, 1.0, 1.0, False, layer=1)
    prof = Profile(
        params=(small, big, lin),
        layers=(
            LayerProfile("emb", 0.001, 0.001, 0, 10, small.bytes + big.bytes),
            LayerProfile("out", 0.002, 0.003, 10**6, 10, lin.bytes),
        ),
        batch_size=256,
        samples_per_batch=256,
        workers=8,
        is_sequential=False,
        sequential_reason="x",
        compute_s=0.007,
        forward_s=0.003,
        backward_s=0.004,
        forward_flops=10**6,
        backward_flops=2 * 10**6,
        update_s_per_byte=1e-10,
        timing_batch_size=256,
    )
    busy = make_cluster([1] * 8, 8, None, 6.25e6, 7e-5, cores_per_host=0.25)
    charged = estimate_hybrid(prof, replace(busy, request_cpu_s=2.3e-4))
    assert charged.partitions["cat.weight"] < 8 <= charged.partitions["user.weight"]
    free = estimate_hybrid(prof, busy)
    assert free.partitions["cat.weight"] >= 8 and free.breakdown["requests"] == 0.0


def test_a_skewed_table_is_cut_finely_whatever_the_latency():
    """A frequency-sorted vocabulary puts most touched rows in its first rows. hpar's client
    sends one request per server holding rows, whatever the partition count, so latency does
    not make partitions dear: the planner cuts the table as finely as it tries (S * 64) at a
    link latency of 1 ms as at 1 us, and the pull's latency term is N * lat, not N * P/S * lat."""
    from hpar.strategies.plan.costmodel import cost_setting
    from hpar.strategies.plan.costmodel_ps import estimate_hybrid, on_ps

    mass = (0.4,) + (0.6 / 255,) * 255  # 40% of the touched rows in the first 1/256
    emb = ParamProfile(
        "emb.weight",
        (1_000_000, 64),
        256_000_000,
        True,
        0.01,
        0.05,
        True,
        layer=0,
        union_curve=((1, 0.01), (8, 0.05)),
        row_mass=mass,
    )
    lin = ParamProfile("out.weight", (64, 64), 16_384, False, 1.0, 1.0, False, layer=1)
    prof = Profile(
        params=(emb, lin),
        layers=(
            LayerProfile("emb", 0.001, 0.001, 0, 10, emb.bytes),
            LayerProfile("out", 0.002, 0.003, 10**6, 10, lin.bytes),
        ),
        batch_size=256,
        samples_per_batch=256,
        workers=8,
        is_sequential=False,
        sequential_reason="x",
        compute_s=0.007,
        forward_s=0.003,
        backward_s=0.004,
        forward_flops=10**6,
        backward_flops=2 * 10**6,
        update_s_per_byte=1e-10,
        timing_batch_size=256,
    )
    for lat in (1e-6, 1e-3):
        cluster = make_cluster([1] * 8, 8, None, 1.25e9, lat)
        assert estimate_hybrid(prof, cluster).partitions["emb.weight"] == 8 * 64
        c = cost_setting(prof, cluster, with_servers=True)
        fine = on_ps(emb, c, True)
        bytes_s = (
            max(
                8 * emb.alpha * 1_000_000 * (256 + 8) * server_imbalance(emb, 512, 8) / 8,
                emb.alpha * 1_000_000 * (256 + 8),
            )
            * 7
            / 8
            / 1.25e9
        )
        assert fine.pull == pytest.approx(bytes_s + 8 * lat, rel=1e-6)


def test_every_strategy_pays_the_batch_draw_and_served_tables_their_dedup():
    """Profile.data_s (a worker draws its batch) lengthens every strategy's step, times the
    host's load; a table on the servers adds its ids' dedup (ParamProfile.dedup_s) to hybrid
    and ps, and a table on AllReduce does not."""
    from dataclasses import replace
    from hpar.strategies.plan.estimates import estimate_all

    prof = _emb_and_dense(workers=2, sequential=True, dedup_s=3e-4)
    emb, lin = prof.params
    for cores, load in ((None, 1.0), (1, 2.0)):  # 2 workers on 1 core: everything on it takes twice as long
        cluster = ClusterSpec(
            hosts=1, gpus_per_host=(2,), servers=1, bandwidth_Bps=1e9, latency_s=1e-5, cores_per_host=cores
        )
        before = {e.strategy: e for e in estimate_all(prof, cluster)}
        after = {e.strategy: e for e in estimate_all(replace(prof, data_s=2e-3), cluster)}
        for name in ("allreduce", "allreduce-sparse", "ps", "hybrid", "pipeline"):
            assert after[name].breakdown["data"] == pytest.approx(load * 2e-3), name
            assert after[name].step_s == pytest.approx(before[name].step_s + load * 2e-3), name
        assert after["hybrid"].placement["emb.weight"] == "ps"
        assert after["hybrid"].breakdown["lookup"] == pytest.approx(load * 3e-4)
        no_dedup = estimate_all(replace(prof, params=(replace(emb, dedup_s=0.0), lin)), cluster)
        assert before["hybrid"].step_s - {e.strategy: e for e in no_dedup}["hybrid"].step_s == pytest.approx(
            load * 3e-4
        )


def test_frozen_parameters_are_neither_exchanged_nor_updated_by_any_strategy():
    """A frozen parameter (requires_grad=False, ParamProfile.frozen) has no gradient: DDP buckets
    none, FSDP2 reduce-scatters none (though it gathers it), a pipeline replica averages none,
    and no optimizer steps it (issue 67): the bytes and the update leave it out."""
    from dataclasses import replace
    from hpar.strategies.job.compression import Compression
    from hpar.strategies.plan.costmodel import estimate_allreduce
    from hpar.strategies.plan.costmodel_compress import estimate_compressed
    from hpar.strategies.plan.costmodel_fsdp import estimate_fsdp
    from hpar.strategies.plan.costmodel_pipeline import estimate_pipeline_grid

    prof = _emb_and_dense(workers=2, sequential=True)
    emb, lin = prof.params
    frozen = replace(prof, params=(replace(emb, frozen=True), lin))
    assert frozen.trainable_bytes == lin.bytes and frozen.total_bytes == prof.total_bytes
    two = ClusterSpec(hosts=1, gpus_per_host=(2,), servers=1, bandwidth_Bps=1e9, latency_s=1e-5)
    ar, ar_all = estimate_allreduce(frozen, two), estimate_allreduce(prof, two)
    assert ar.bytes_per_step == lin.bytes and ar_all.bytes_per_step == emb.bytes + lin.bytes  # 2(N-1)/N = 1
    assert ar.breakdown["update"] == pytest.approx(lin.bytes * 1e-10) and ar.breakdown["comm_tail"] == 0.0
    half = estimate_compressed(frozen, two, ar, Compression("fp16"))
    assert half.bytes_per_step == pytest.approx(lin.bytes / 2)  # fp16: half of what is sent, nothing frozen
    sparse = estimate_allreduce_sparse(frozen, two)
    assert sparse.bytes_per_step == lin.bytes and sparse.breakdown["merge"] == 0.0  # no gathered rows
    fsdp, fsdp_all = estimate_fsdp(frozen, two), estimate_fsdp(prof, two)
    share = emb.bytes / 2 + lin.bytes / 2  # (N-1)/N of every parameter: gathered twice, frozen ones too
    assert fsdp.bytes_per_step == pytest.approx(2 * share + 2 * lin.bytes / 2)  # gloo: ReduceScatter as AllReduce
    assert fsdp_all.bytes_per_step == pytest.approx(4 * share)
    assert fsdp.breakdown["update"] == pytest.approx(lin.bytes / 2 * 1e-10)
    four = ClusterSpec(hosts=1, gpus_per_host=(4,), servers=1, bandwidth_Bps=1e9, latency_s=1e-5)
    pipe = estimate_pipeline_grid(frozen, four, replicas=2)  # 2 stages x 2 replicas: stage 0 all frozen
    assert pipe.stages == ((0, 1), (1, 2))
    assert pipe.breakdown["update"] == pytest.approx(lin.bytes * 1e-10)  # stage 0 steps nothing
    assert pipe.bytes_per_step - estimate_pipeline_grid(prof, four, replicas=2).bytes_per_step == pytest.approx(
        -emb.bytes / 2
    )  # stage 0's replicas average nothing (per worker: over K = 2 stages)
