"""The cluster a plan is made for: hosts, GPUs (workers) per host, parameter servers, and the
network link figures, given by flags or measured by a short loopback probe.

No launcher imports here: ``launcher/commands/profile.py`` parses ``--hosts`` with
``launcher.hosts.parse_hosts`` and passes the slot counts to :func:`make_cluster`.

Link model used by the cost model (``strategies/plan/costmodel.py``): every host has one
full-duplex network link of ``bandwidth_Bps`` bytes/s each way, and a message costs
``latency_s`` plus its size over the bandwidth (the alpha-beta or Hockney model, Hockney,
"The communication challenge for MPP", Parallel Computing 1994). Traffic between processes
of one host uses ``intra_host_Bps`` (shared memory, PCIe or NVLink; loopback on a CPU box);
it defaults to ``bandwidth_Bps`` because we cannot measure a GPU interconnect we do not have.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Sequence

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_TIME = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"


@dataclass(frozen=True)
class ClusterSpec:
    """``hosts`` machines with ``gpus_per_host[h]`` workers each (len == hosts), ``servers``
    parameter-server processes (one per host by default, as in Parallax), inter-host link
    ``bandwidth_Bps`` (bytes/s, each direction) and ``latency_s`` (seconds per message),
    ``device_flops`` (FLOP/s of one worker's device; None: use the profiled CPU times),
    ``intra_host_Bps`` (None: same as ``bandwidth_Bps``), ``source`` (where the link figures
    came from: "flags", "probe" or "default"), ``cores_per_host`` (CPU cores a host gives its
    hpar processes when they compute on the CPU, so that more processes than cores share
    them: for this machine's workers, the cores' worth they get computing at once, measured by
    strategies/plan/probe_cores.py, where a VM's vCPUs may give less than one core each; None:
    workers have their own accelerator, or the hosts are not this machine),
    ``device_mem_Bps`` (memory bytes/s of that device, ``--device-mem-gbps``: with
    ``device_flops`` the roofline of strategies/plan/roofline.py; None: device_flops / 20),
    ``allreduce_Bps`` (the bandwidth a ring AllReduce between processes of one host achieves,
    ``2(N-1)/N * bytes / seconds``, its reductions and copies included; measured by the
    probe, where gloo on CPU reaches about 0.4 of the point-to-point figure; None: the
    intra-host bandwidth), ``allgather_Bps`` (between hosts: the rate at which a two-rank
    AllGather moves each rank's bytes, both directions busy at once, as measured between two
    hosts by the probe; gloo gets less than the one-way link there; None: the link's
    bandwidth), ``request_cpu_s`` (CPU seconds a small parameter-server request
    costs its worker and server together, hpar's own client and server code included,
    measured by strategies/plan/probe.probe_requests on this machine; the cost model charges
    it where processes share busy cores; None: not measured, not charged), ``sparse_round_s``
    (seconds of one sparse gradient's exchange over all the workers, bytes aside: gloo's sparse
    AllReduce of a one-row gradient, measured over the emulated hosts by
    strategies/plan/probe.probe_sparse_round, among one host's CPU workers by
    strategies/plan/probe_collectives.py; None: the cost model's two rounds of N-1 latencies),
    ``gradient_exchange_s`` (seconds of one job's whole allreduce-sparse gradient exchange over
    all the workers at the profiled sizes, as DDP runs it: every embedding table's sparse
    AllReduce and the dense buckets' AllReduce in flight together, measured over the emulated
    hosts by strategies/plan/probe.probe_gradient_exchange for the job ``hpar bench`` profiled;
    it replaces the AllReduce and AllGather terms of that job's allreduce-sparse estimate; None:
    not measured), ``worker_memory_bytes`` (the memory of one worker's device: a GPU's, or a CPU
    worker's share of its host's RAM; ``--worker-memory``) and ``server_memory_bytes`` (a
    parameter server's share of its host's RAM; ``--server-memory``); None: not known, no plan
    is refused for memory (strategies/plan/memory_model.py). ``allreduce_fixed_s``, ``allgather_fixed_s``
    and ``reduce_scatter_fixed_s``: seconds of one small gloo collective of that kind over the
    workers of a one-host cluster on this machine's CPU, bytes aside (wake-ups of gloo's threads
    on shared cores, many times the link's latency (BENCHMARKS.md, "The cost model against
    measurement")), measured by strategies/plan/probe_collectives.py; None: not measured, the
    cost model
    charges N - 1 latencies per round."""

    hosts: int
    gpus_per_host: tuple[int, ...]
    servers: int
    bandwidth_Bps: float
    latency_s: float
    device_flops: float | None = None
    intra_host_Bps: float | None = None
    source: str = "flags"
    cores_per_host: float | None = None
    allreduce_Bps: float | None = None
    device_mem_Bps: float | None = None
    request_cpu_s: float | None = None
    allgather_Bps: float | None = None
    sparse_round_s: float | None = None
    gradient_exchange_s: float | None = None
    worker_memory_bytes: float | None = None
    server_memory_bytes: float | None = None
    allreduce_fixed_s: float | None = None
    allgather_fixed_s: float | None = None
    reduce_scatter_fixed_s: float | None = None

    def __post_init__(self):
        if self.hosts < 1 or len(self.gpus_per_host) != self.hosts or min(self.gpus_per_host) < 1:
            raise ValueError(
                f"--hosts/--gpus: need at least one host with at least one GPU each, got {self.gpus_per_host}"
            )
        if self.servers < 1:
            raise ValueError(f"--servers must be at least 1, got {self.servers}")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"--bandwidth must be positive, got {self.bandwidth_Bps} B/s")
        if not self.latency_s >= 0:
            raise ValueError(f"--latency must not be negative, got {self.latency_s} s")
        if self.cores_per_host is not None and not self.cores_per_host > 0:
            raise ValueError(f"cores per host must be positive, got {self.cores_per_host}")
        if self.device_mem_Bps is not None and self.device_flops is None:
            raise ValueError(
                "--device-mem-gbps needs --device-tflops too: a projected device has a compute rate "
                "and a memory bandwidth (roofline); add --device-tflops T"
            )
        for flag, value in (
            ("--worker-memory", self.worker_memory_bytes),
            ("--server-memory", self.server_memory_bytes),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be positive (GB, 10^9 bytes), got {value / 1e9:g}")
        if self.device_flops is not None:
            self.device  # raises ValueError naming the flag for a rate that is not positive

    @property
    def device(self):
        """The projected worker device (strategies/plan/roofline.DeviceSpec), or None: compute
        as profiled."""
        from hpar.strategies.plan.roofline import DeviceSpec

        return DeviceSpec(self.device_flops, self.device_mem_Bps) if self.device_flops is not None else None

    @property
    def workers(self) -> int:
        """N, the number of worker processes (GPUs)."""
        return sum(self.gpus_per_host)

    @property
    def max_gpus_per_host(self) -> int:
        return max(self.gpus_per_host)

    @property
    def intra_Bps(self) -> float:
        return self.intra_host_Bps or self.bandwidth_Bps

    @property
    def collective_Bps(self) -> float:
        """Bandwidth of the slowest link a ring over all workers crosses: the network when
        the ring spans hosts; on a single host the measured AllReduce figure, else the
        intra-host one."""
        return self.bandwidth_Bps if self.hosts > 1 else (self.allreduce_Bps or self.intra_Bps)

    @property
    def gather_Bps(self) -> float:
        """Bandwidth of a ring AllGather over all workers (sparse gradients): the measured
        ``allgather_Bps`` when the ring spans hosts and it was probed, else :attr:`collective_Bps`.
        The probe measures two hosts, whose AllGather sends and receives on one connection; a
        wider ring's neighbours are two peers (an assumption the scaling runs check)."""
        return (self.allgather_Bps or self.bandwidth_Bps) if self.hosts > 1 else self.collective_Bps


def parse_bandwidth(text: str, flag: str = "--bandwidth") -> float:
    """``"10Gbps"``, ``"10Gbit"``, ``"10gbit/s"``, ``"100Mb/s"`` (bits), ``"25GB/s"``,
    ``"25GBps"``, ``"1.5GiB/s"`` (bytes) -> bytes per second (float). SI prefixes are powers
    of 10, ``Ki/Mi/Gi/Ti`` powers of 2; a lowercase ``b``/``bit`` is bits, an uppercase
    ``B``/``byte`` is bytes. Raises ValueError naming ``flag`` for anything else."""
    m = re.fullmatch(
        _NUM + r"\s*([A-Za-z]*)(bps|Bps|bit/s|bits/s|bit|bits|b/s|B/s|bytes/s|byte/s|B)", (text or "").strip()
    )
    if m is None:
        raise ValueError(f"{flag} {text!r}: give a number and a unit, e.g. 10Gbps, 100Mbit, 25GB/s")
    value, prefix, unit = float(m.group(1)), m.group(2).lower(), m.group(3)
    if prefix not in _PREFIX:
        raise ValueError(f"{flag} {text!r}: unknown prefix {m.group(2)!r}; use k, M, G, T (or Ki, Mi, Gi, Ti)")
    bits = unit.startswith("b") and not unit.startswith("byte")
    bps = value * _PREFIX[prefix] / (8.0 if bits else 1.0)
    if bps <= 0:
        raise ValueError(f"{flag} {text!r}: bandwidth must be positive")
    return bps


def parse_latency(text: str, flag: str = "--latency") -> float:
    """``"50us"``, ``"50µs"``, ``"1ms"``, ``"0.2s"``, ``"100ns"`` -> seconds (float).
    Raises ValueError naming ``flag`` when the unit is missing or unknown."""
    m = re.fullmatch(_NUM + r"\s*(ns|us|µs|ms|s)", (text or "").strip())
    if m is None:
        raise ValueError(f"{flag} {text!r}: give a number and a unit, e.g. 50us, 1ms")
    return float(m.group(1)) * _TIME[m.group(2)]


def check_link_flags(bandwidth: str | None, latency: str | None) -> None:
    """Check ``--bandwidth`` and ``--latency`` as given (None: not given) before anything is
    loaded or measured. Raises ValueError naming the flag, as :func:`parse_bandwidth` and
    :func:`parse_latency` do."""
    if bandwidth is not None:
        parse_bandwidth(bandwidth)
    if latency is not None:
        parse_latency(latency)


def make_cluster(
    slots: Sequence[int] | None,
    gpus: int | None,
    servers: int | None,
    bandwidth_Bps: float,
    latency_s: float,
    **figures,
) -> ClusterSpec:
    """A ClusterSpec from host slot counts (``slots``, None: this machine only) and
    ``--gpus`` (None: every slot). GPUs fill hosts in order, as the launcher places ranks;
    hosts left without a GPU are dropped. ``servers`` None means one per host used.
    ``figures``: the ClusterSpec's other fields by name (``device_flops``, ``intra_host_Bps``,
    ``source``, ``cores_per_host``, the measured collectives, the memory per process; absent:
    the field's default). Raises ValueError when ``--gpus`` exceeds the slots or is below 1,
    TypeError for a name that is not a ClusterSpec field."""
    if gpus is not None and gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {gpus}")
    if not slots:
        slots = [gpus or 1]
    total = sum(slots)
    n = total if gpus is None else gpus
    if n > total:
        raise ValueError(f"--gpus {n} exceeds the {total} slots of --hosts; add hosts or lower --gpus")
    per_host, left = [], n
    for s in slots:
        if left <= 0:
            break
        per_host.append(min(s, left))
        left -= per_host[-1]
    return ClusterSpec(
        hosts=len(per_host),
        gpus_per_host=tuple(per_host),
        servers=len(per_host) if servers is None else servers,
        bandwidth_Bps=bandwidth_Bps,
        latency_s=latency_s,
        **figures,
    )


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``addr`` a moment ago (a process group's MASTER_PORT;
    ``""``: every interface)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
