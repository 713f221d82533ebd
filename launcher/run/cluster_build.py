"""The cluster a plan is for, from the command's flags (``--gpus``, ``--hosts``, ``--servers``,
``--bandwidth``, ``--latency``, ``--device-tflops``, ``--device-mem-gbps``, the memory flags):
a :class:`hpar.strategies.plan.cluster.ClusterSpec` for the cost model and the memory model.
Hosts may be real (a host file or ``a:2,b:2``, the Slurm allocation), a projection (``8x6``)
or emulated (``emulate:H``, the hosts ``hpar bench --hosts emulate:H`` runs on). Without
``--bandwidth``, when every host is this machine, the link is measured by a loopback probe
(strategies/plan/probe.py); for remote hosts hpar assumes ``DEFAULT_BANDWIDTH`` and says so.
Shared by ``hpar profile``, ``hpar run``'s planner and ``hpar bench``.
"""

from __future__ import annotations

import dataclasses
import os

DEFAULT_BANDWIDTH = "10Gbps"
DEFAULT_LATENCY = "50us"


def build_cluster(
    gpus, hosts, servers, bandwidth, latency, device_tflops, device_mem_gbps=None, measured_on=None, capacity=None
):
    """ClusterSpec from the flags (see the module docstring); ``device_mem_gbps``: the projected
    device's memory bandwidth (GB/s); ``measured_on``: the device the profile measures on
    ("cuda": no CPU-core sharing in the cost model; None: "cuda" when this machine has a GPU);
    ``capacity``: ``--worker-memory``/``--server-memory`` (strategies/plan/capacity.py), this
    machine's defaults filled in where every host is this one. Raises ValueError naming the flag."""
    from hpar.strategies.plan.capacity import Capacity, with_defaults

    cluster = _cluster(gpus, hosts, servers, bandwidth, latency, device_tflops, device_mem_gbps, measured_on)
    local = cluster.device_flops is None and _all_local(hosts)
    procs = cluster.max_gpus_per_host + -(-cluster.servers // cluster.hosts)
    cap = with_defaults(capacity or Capacity(), local, measured_on or "cpu", procs)
    return dataclasses.replace(cluster, worker_memory_bytes=cap.worker_bytes, server_memory_bytes=cap.server_bytes)


def _all_local(hosts) -> bool:
    """Whether every host of ``--hosts`` is this machine (no flag: yes; emulated hosts share it)."""
    from hpar.launcher.hosts.emulated import parse_emulate
    from hpar.launcher.hosts.ray_nodes import cluster_hosts
    from hpar.launcher.hosts.slurm import in_allocation

    if not hosts:
        return not in_allocation()
    if parse_emulate(hosts):
        return True
    try:
        return all(h.is_local for h in cluster_hosts(hosts))
    except ValueError:  # HxG: a projection
        return False


def _cluster(gpus, hosts, servers, bandwidth, latency, device_tflops, device_mem_gbps=None, measured_on=None):
    """build_cluster without the memory capacity."""
    from hpar.launcher.hosts.ray_nodes import cluster_hosts
    from hpar.strategies.plan.cluster import make_cluster, parse_bandwidth, parse_latency
    from hpar.strategies.plan.probe import probe_link
    from hpar.strategies.specs.registry import HYBRID
    from hpar.launcher.hosts.slurm import allocation_hosts, in_allocation
    from hpar.launcher.hosts.emulated import parse_emulate

    emulated = parse_emulate(hosts)
    if emulated:
        if device_tflops is not None or device_mem_gbps is not None:
            raise ValueError(
                f"--hosts {hosts} runs on this machine's CPU; drop --device-tflops/--device-mem-gbps "
                "(they project to a device you do not have)"
            )
        return _emulated_cluster(emulated, gpus, servers, bandwidth, latency)
    # inside a Slurm allocation the hosts and their slots come from Slurm unless --hosts is given
    host_list = cluster_hosts(hosts) if hosts else (allocation_hosts() if in_allocation() else [])
    if device_tflops is not None and device_tflops <= 0:
        raise ValueError(f"--device-tflops must be positive, got {device_tflops}")
    if device_mem_gbps is not None and device_mem_gbps <= 0:
        raise ValueError(f"--device-mem-gbps must be positive, got {device_mem_gbps}")
    flops = device_tflops * 1e12 if device_tflops is not None else None
    mem = device_mem_gbps * 1e9 if device_mem_gbps is not None else None
    local = all(h.is_local for h in host_list)
    allreduce_bw = None
    if bandwidth is not None:
        bw, source = parse_bandwidth(bandwidth), "flags"
        lat = parse_latency(latency or DEFAULT_LATENCY)
    elif local:
        bw, lat, allreduce_bw = probe_link()[:3]
        source = "probe"
        if latency is not None:
            lat = parse_latency(latency)
    else:
        bw, lat, source = parse_bandwidth(DEFAULT_BANDWIDTH), parse_latency(latency or DEFAULT_LATENCY), "default"
    slots = [h.slots for h in host_list] or None
    import torch

    # workers on this machine's CPU share its cores (cost model: strategies.costmodel.cpu_share)
    on_cpu = measured_on == "cpu" if measured_on else not torch.cuda.is_available()
    cores = float(os.cpu_count() or 1) if local and flops is None and on_cpu else None
    # a request's CPU matters where the processes share busy cores: only then is it measured
    request_cpu = HYBRID.load("cluster_probe")() if cores is not None else None
    cluster = make_cluster(
        slots,
        gpus,
        servers,
        bw,
        lat,
        device_flops=flops,
        source=source,
        cores_per_host=cores,
        allreduce_Bps=allreduce_bw,
        device_mem_Bps=mem,
        request_cpu_s=request_cpu,
    )
    if cores is not None and cluster.workers > 1:  # as many cores as they are worth computing at once
        from hpar.strategies.plan.probe_cores import effective_cores

        cluster = dataclasses.replace(cluster, cores_per_host=effective_cores(int(cores)) or cores)
    # gloo's collectives among this machine's worker processes: their fixed time, measured where
    # the link is (link flags describe another network: its latencies, as the model takes them)
    if cores is not None and source == "probe" and cluster.hosts == 1 and cluster.workers > 1:
        from hpar.strategies.plan.probe_collectives import probe_collectives

        times = probe_collectives(cluster.workers)
        if times is not None:
            cluster = dataclasses.replace(
                cluster,
                allreduce_fixed_s=times.allreduce_s,
                allgather_fixed_s=times.allgather_s,
                reduce_scatter_fixed_s=times.reduce_scatter_s,
                sparse_round_s=times.sparse_round_s,
            )
    return cluster


def _emulated_cluster(hosts: int, gpus, servers, bandwidth, latency):
    """``--hosts emulate:H`` (launcher/bench/emulate.py): ``ceil(gpus / H)`` workers on each of H
    network namespaces of this machine, each host's link capped at ``bandwidth`` (None: not
    capped, the loopback's rate). The hosts share this machine's cores (cpu_count / H each)
    and their processes talk to each other over its loopback (the probed intra-host rate); a
    parameter-server request's CPU is measured too (the hybrid spec's ``cluster_probe``)."""
    from hpar.launcher.hosts.emulated import slots_per_host
    from hpar.strategies.plan.cluster import make_cluster, parse_bandwidth, parse_latency
    from hpar.strategies.plan.probe import probe_link
    from hpar.strategies.specs.registry import HYBRID

    gpus = gpus or hosts
    slots = [slots_per_host(hosts, gpus)] * hosts
    loop_bw, loop_lat = probe_link()[:2]
    bw = parse_bandwidth(bandwidth, "--bandwidth") if bandwidth is not None else loop_bw
    lat = parse_latency(latency) if latency is not None else loop_lat
    return make_cluster(
        slots,
        gpus,
        servers,
        bw,
        lat,
        intra_host_Bps=loop_bw,
        source="flags" if bandwidth is not None else "probe",
        cores_per_host=(os.cpu_count() or 1) / hosts,
        request_cpu_s=HYBRID.load("cluster_probe")(),
    )
