"""What ``hpar bench`` settles before and around its runs: the checks every bench makes on its
flags and scripts, the emulated link as measured (and a script's gradient exchange over it), and
the cost model's cluster for each GPU count (the bench's hosts, or a projection to more)."""

from __future__ import annotations

import dataclasses
import datetime
import os


def check_common(
    scripts, steps: int, timeout_s: float, plot_out, bench_dir, repeat: int = 1, min_seconds: float = 0.0
) -> str:
    """The checks every ``hpar bench`` makes before it runs anything (ValueError naming the
    flag or the script); returns the absolute bench directory (default runs/bench-<UTC time>)."""
    if steps < 4:
        raise ValueError(f"--steps must be at least 4 (2 warm-up steps, then measured ones), got {steps}")
    if timeout_s <= 0:
        raise ValueError(f"--timeout must be positive, got {timeout_s}")
    if repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {repeat}")
    if min_seconds < 0:
        raise ValueError(f"--min-seconds must be 0 or more, got {min_seconds}")
    for s in scripts:
        if not os.path.isfile(s):
            raise ValueError(f"{s}: no such script; pass the path of a training script")
    if plot_out:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install 'hpar[plot]' (or matplotlib)")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return os.path.abspath(bench_dir or os.path.join("runs", f"bench-{stamp}"))


def probe_emulated_link(em, console):
    """The emulated link's LinkFigures as measured, announced on the console (None on one host)."""
    link = em.probe_link()
    if link is not None:
        cap = f" (cap {em.bandwidth_Bps / 1e6:.2f} MB/s)" if em.bandwidth_Bps else ""
        console.print(
            f"hpar bench: emulated link measured at {link[0] / 1e6:.2f} MB/s{cap}, "
            f"latency {link[1] * 1e6:.0f} us"
            + (
                f", a sparse gradient's exchange over {em.n_hosts} hosts {link.sparse_round_s * 1e3:.1f} ms"
                if link.sparse_round_s is not None
                else ""
            ),
            markup=False,
        )
    return link


def with_exchange(em, console, profile, cluster):
    """``cluster`` with the job's allreduce-sparse gradient exchange (sparse tables and dense
    buckets in flight together) as measured over the emulated hosts at its own sizes
    (``EmulatedCluster.probe_exchange``), announced on the console; unchanged without an
    embedding table, on one host, or with more workers than hosts (the probe runs one process
    per host)."""
    if cluster.workers != em.n_hosts:
        return cluster
    seconds = em.probe_exchange(profile)
    if seconds is None:
        return cluster
    console.print(
        f"hpar bench: this script's gradient exchange (sparse tables and dense buckets) over "
        f"{em.n_hosts} hosts, measured at its own sizes: {seconds * 1e3:.1f} ms",
        markup=False,
    )
    return dataclasses.replace(cluster, gradient_exchange_s=seconds)


def cluster_factory(
    gpus_per_host: int | None,
    hosts: str | None,
    bandwidth_Bps: float | None,
    latency: str | None,
    device_tflops: float | None,
    bench_gpus: int,
    emulated_hosts: int | None = None,
    link=None,
    capacity=None,
):
    """gpus -> ClusterSpec for the cost model: the bench's hosts for the bench's GPU count;
    for a projection, hosts of ``gpus_per_host`` (or of the bench's busiest host) GPUs each.
    The link is ``bandwidth_Bps`` or one loopback probe (``profile_cli.build_cluster``).
    ``emulated_hosts`` H: the hosts are this machine's namespaces (``hpar profile --hosts
    emulate:H`` describes the same cluster: shared cores, loopback within a host). ``link``: the
    emulated link's (bandwidth, latency, ...) as measured (``EmulatedCluster.probe_link``), which the cost model then uses
    instead of the cap (its latency unless ``latency`` is given); ``capacity``: the memory of a
    worker and a server (strategies/plan/capacity.py), this machine's where not given."""
    from hpar.launcher.run.cluster_build import build_cluster
    from hpar.strategies.plan.cluster import make_cluster

    bw = f"{bandwidth_Bps}B/s" if bandwidth_Bps else None
    base = build_cluster(
        bench_gpus, f"emulate:{emulated_hosts}" if emulated_hosts else hosts, None, bw, latency, None, capacity=capacity
    )
    if link is not None:
        base = dataclasses.replace(
            base,
            bandwidth_Bps=link[0],
            latency_s=base.latency_s if latency else link[1],
            allgather_Bps=link.allgather_Bps,
            sparse_round_s=link.sparse_round_s,
            source="probe between emulated hosts",
        )

    def cluster_of(gpus: int):
        flops = device_tflops * 1e12 if device_tflops and gpus != bench_gpus else None
        if gpus == bench_gpus and not flops:
            return base
        g = gpus_per_host or base.max_gpus_per_host
        return make_cluster(
            [g] * -(-gpus // g),
            gpus,
            None,
            base.bandwidth_Bps,
            base.latency_s,
            device_flops=flops,
            source=base.source,
            allreduce_Bps=None if flops else base.allreduce_Bps,
            allgather_Bps=base.allgather_Bps,
        )

    return cluster_of


def link_words(link_rate: str | None, link_queue: str) -> str:
    """`` at 25mbit`` (`` at 25mbit, fair queues``) for the titles; empty without a cap."""
    if not link_rate:
        return ""
    return f" at {link_rate}" + (", fair queues" if link_queue == "fair" else "")
