"""The cluster probes `hpar profile` and `hpar run` use on this machine: the loopback link and
AllReduce figures, each collective over N threads, a job's gradient exchange in flight, gloo's
sparse round."""

import os

import pytest


@pytest.mark.timeout(120)
def test_local_cluster_is_probed_for_link_and_allreduce_figures():
    from hpar.launcher.run.cluster_build import build_cluster

    c = build_cluster(2, None, None, None, None, None)
    assert c.source == "probe" and c.hosts == 1 and c.workers == 2
    assert 0 < c.bandwidth_Bps < 1e12 and 0 <= c.latency_s < 0.1
    assert 0 < c.allreduce_Bps < 1e12 and c.collective_Bps == c.allreduce_Bps
    from hpar.strategies.plan.probe import probe_link

    assert c.allgather_Bps is None  # one host: the AllGather is not probed (the model uses allreduce_Bps)
    assert 0 < probe_link(nbytes=1 << 20, pings=4, sends=2, allgather=True).allgather_Bps < 1e12
    # CPU workers sharing this machine's cores: a parameter-server request's CPU is measured too
    # ... and the cores' worth the workers get computing at once (probe_cores.py): at most the cores
    cores = os.cpu_count() or 1
    assert (1.0 <= c.cores_per_host <= cores if cores > 1 else c.cores_per_host == 1) and 1e-6 < c.request_cpu_s < 0.05
    assert build_cluster(1, None, None, None, None, None).cores_per_host == cores  # one worker: not probed
    assert build_cluster(2, None, None, "1Gbps", None, 100.0).request_cpu_s is None  # a projected GPU: not charged
    # gloo's small collectives among the two workers: measured
    assert all(
        0 < t < 0.5 for t in (c.allreduce_fixed_s, c.allgather_fixed_s, c.reduce_scatter_fixed_s, c.sparse_round_s)
    )
    assert build_cluster(1, None, None, None, None, None).allreduce_fixed_s is None  # one worker: no collective
    assert build_cluster(2, None, None, "1Gbps", None, 100.0).allreduce_fixed_s is None  # not this CPU's


def test_collective_probe_times_each_kind_over_n_threads_and_refuses_what_it_cannot_measure():
    from hpar.strategies.plan.probe_collectives import MAX_ENDPOINTS, probe_collectives
    import threading

    before = threading.active_count()
    three = probe_collectives(3, reps=5, warm=1)
    assert three is not None and all(0 < t < 1.0 for t in three)
    assert probe_collectives(1) is None and probe_collectives(MAX_ENDPOINTS + 1) is None
    assert threading.active_count() <= before + 1  # its endpoints' threads have ended


def rank0_of_three_threads(probe, limit_s: float) -> float:
    """``probe(addr, port, rank, world)`` (a probe run as one process per emulated host in
    `hpar bench`) as 3 threads over loopback: ranks 1 and 2 return None, rank 0 its seconds
    (checked to lie in (0, ``limit_s``)), which this returns."""
    import threading
    from hpar.strategies.plan.cluster import free_port

    port, out = free_port(), {}

    def rank(r):
        try:
            out[r] = probe("127.0.0.1", port, r, 3)
        except Exception as exc:  # reported below
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert out[1] is None and out[2] is None, out
    assert isinstance(out[0], float) and 0 < out[0] < limit_s, out
    return out[0]


@pytest.mark.timeout(120)
def test_gradient_exchange_probe_times_a_jobs_tables_and_dense_buckets_in_flight_together():
    """probe_gradient_exchange with two tables at a job's sizes (rows a batch touches, dim, table
    rows) and a dense bucket between them: rank 0 gets the mean seconds of the exchange; more
    rows, or a larger dense bucket, take longer."""
    from hpar.strategies.plan.probe import probe_gradient_exchange

    exchange = lambda items: lambda *where: probe_gradient_exchange(*where, items, reps=2, timeout_s=60)
    small = rank0_of_three_threads(exchange([[4, 8, 100], [64], [2, 8, 50]]), 5.0)
    assert rank0_of_three_threads(exchange([[20_000, 256, 40_000], [64], [2, 8, 50]]), 5.0) > small  # 20 MB a rank
    assert rank0_of_three_threads(exchange([[4, 8, 100], [5_000_000], [2, 8, 50]]), 5.0) > small  # 20 MB dense


@pytest.mark.timeout(120)
def test_sparse_round_probe_times_gloos_sparse_allreduce_over_all_ranks():
    """probe_sparse_round: rank 0 gets the mean seconds of a one-row sparse AllReduce."""
    from hpar.strategies.plan.probe import probe_sparse_round

    rank0_of_three_threads(lambda *where: probe_sparse_round(*where, reps=4, timeout_s=60), 1.0)
