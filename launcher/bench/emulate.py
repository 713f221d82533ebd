"""``hpar bench --hosts emulate:H [--link-rate 1gbit [--link-queue fair]]``: an emulated cluster on this machine.

H test hosts are made with ``scripts/testhosts.py`` (network namespaces on a bridge, each with
its own sshd, every host's link capped both ways at ``--link-rate``, behind a first-in first-out
queue (``tc tbf``) or, with ``--link-queue fair``, a per-flow fair one that sends small packets
first, as a Linux host's default queue does (scripts/linkqueue.py)); it lives
in the repository's scripts/ folder, not in the package, so it is imported by path from the
repository this module belongs to. Workers go ``ceil(G/H)`` per host over SSH, exactly as
``hpar run --hosts`` places them (the spec ``emulate:H`` is parsed by launcher/hosts/emulated.py).
Everything made is removed when the bench ends, also on failure or Ctrl-C. While each strategy
runs, the hosts' byte counters are sampled (launcher/bench/byte_counts.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import threading
import time

from hpar.launcher.bench.byte_counts import Sample, byte_check, read_counter, socket_bytes, socket_total
from hpar.launcher.hosts.emulated import slots_per_host

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # launcher/bench/ -> the checkout
SAMPLE_S = 0.5


def testhosts_module():
    """scripts/testhosts.py of this repository, imported by path. Raises ValueError when the
    checkout has no scripts/ folder (an installed, non-editable hpar)."""
    path = os.path.join(REPO, "scripts", "testhosts.py")
    if not os.path.exists(path):
        raise ValueError("--hosts emulate:H needs scripts/testhosts.py from an hpar checkout (pip install -e .)")
    import sys

    if "hpar_testhosts" in sys.modules:
        return sys.modules["hpar_testhosts"]
    spec = importlib.util.spec_from_file_location("hpar_testhosts", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["hpar_testhosts"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def rate_arg(bandwidth_Bps: float) -> str:
    """bytes/s -> testhosts' ``--rate`` form (whole bits per second, e.g. ``1000000000bit``)."""
    return f"{int(round(bandwidth_Bps * 8))}bit"


def _free_net() -> int:
    used = set(
        re.findall(r"10\.77\.(\d+)\.", subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout)
    )
    for net in range(10, 100):
        if str(net) not in used:
            return net
    raise RuntimeError("no free 10.77.N.0/24 subnet for test hosts (10..99 all in use)")


class EmulatedCluster:
    """Context manager: ``with EmulatedCluster(2, 4, 1.25e8) as em: ...`` makes the hosts,
    writes ``em.host_file`` (``root@ADDR:22 slots=S``) and ``em.key``; leaving removes them.
    ``queue``: the links' queue behind the cap, ``"fifo"`` or ``"fair"`` (scripts/linkqueue.py).
    Raises ValueError (one line) without root or the tools ``testhosts.unavailable`` names, and
    for a ``"fair"`` queue without a cap (``bandwidth_Bps`` None)."""

    def __init__(self, hosts: int, gpus: int, bandwidth_Bps: float | None, queue: str = "fifo"):
        self.n_hosts, self.gpus, self.bandwidth_Bps, self.queue = hosts, gpus, bandwidth_Bps, queue
        if queue != "fifo" and not bandwidth_Bps:
            raise ValueError(f"--link-queue {queue} is the queue behind the emulated link's cap: give --link-rate too")
        self.slots = slots_per_host(hosts, gpus)
        self._th = None
        self.made = None
        self._sockets: dict[str, dict[str, int]] = {}  # last socket reading per host
        self._tcp: dict[str, int] = {}  # running TCP total per host

    def __enter__(self) -> "EmulatedCluster":
        if os.geteuid() != 0:
            raise ValueError("--hosts emulate:H needs root (network namespaces, tc); run hpar bench as root")
        self._th = testhosts_module()
        why = self._th.unavailable()
        if why:
            raise ValueError(f"--hosts emulate:H: {why}")
        net = _free_net()
        self.prefix = f"hb{net}"
        rate = rate_arg(self.bandwidth_Bps) if self.bandwidth_Bps else None
        try:
            self.made = self._th.up(self.n_hosts, rate=rate, prefix=self.prefix, net=net, queue=self.queue)
        except BaseException:
            self._th.down(self.prefix)
            raise
        os.environ["HPAR_SSH_KNOWN_HOSTS"] = self.made.known_hosts  # for the `hpar run`s the bench starts
        self.host_file = os.path.join(self.made.directory, "bench-hosts.txt")
        with open(self.host_file, "w") as f:
            f.writelines(f"root@{h.address}:22 slots={self.slots}\n" for h in self.made.hosts)
        return self

    def __exit__(self, *exc) -> None:
        if self._th is not None and self.made is not None:
            self._th.down(self.prefix)

    def _probe_processes(self, ranks: int, args: list[str], timeout_s: float) -> str:
        """Run ``python -m hpar.strategies.plan.probe ADDR PORT RANK *args`` in the namespaces of
        hosts 0 .. ``ranks``-1 (rank 0 hosts the store) and return rank 0's last line of output.
        Raises RuntimeError naming the probe when one fails or outlives ``timeout_s``; kills only
        the probe's own process groups."""
        import sys

        addr, port = self.made.hosts[0].address, 29400 + int(self.prefix[2:])
        procs = [
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.made.hosts[r].namespace,
                    "env",
                    "GLOO_SOCKET_IFNAME=eth0",
                    "OMP_NUM_THREADS=1",
                    sys.executable,
                    "-m",
                    "hpar.strategies.plan.probe",
                    addr,
                    str(port),
                    str(r),
                    *args,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for r in range(ranks)
        ]
        what = f"the {('link', 'sparse AllReduce', 'sparse exchange')[min(len(args), 2)]} probe between emulated hosts"
        try:
            out, err = procs[0].communicate(timeout=timeout_s)
            for p in procs[1:]:
                p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{what} took over {timeout_s:.0f} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
        if procs[0].returncode != 0 or not out.strip():
            raise RuntimeError(f"{what} failed: {(err.strip().splitlines() or ['?'])[-1]}")
        return out.strip().splitlines()[-1]

    def probe_link(self, timeout_s: float = 60.0):
        """The link's LinkFigures (strategies/plan/probe.py) measured between hosts 0 and 1 by two gloo
        processes, one in each namespace (strategies/plan/probe.py's ``probe_peer``): what TCP
        through the capped links delivers, for the cost model; with ``sparse_round_s``, the fixed
        time of a sparse gradient's exchange over all the hosts, one process on each
        (``probe_sparse_round``). None with fewer than two hosts.
        Raises RuntimeError when a probe fails or outlives ``timeout_s``."""
        if self.n_hosts < 2:
            return None
        from hpar.strategies.plan.probe import LinkFigures

        link = LinkFigures(**json.loads(self._probe_processes(2, [], timeout_s)))
        sparse = json.loads(self._probe_processes(self.n_hosts, [str(self.n_hosts)], timeout_s))
        return link._replace(sparse_round_s=sparse["sparse_round_s"])

    def probe_exchange(self, profile, timeout_s: float = 180.0) -> float | None:
        """Seconds of ``profile``'s whole allreduce-sparse gradient exchange over all the hosts,
        one process on each, at the job's own sizes (strategies/plan/probe.probe_gradient_exchange
        of what ``exchange_items`` lists). None with fewer than two hosts or no embedding table
        (the job then runs allreduce-sparse as allreduce). Raises RuntimeError when the probe
        fails or outlives ``timeout_s``."""
        from hpar.strategies.plan.probe import exchange_items

        items = exchange_items(profile)
        if self.n_hosts < 2 or not any(len(item) == 3 for item in items):
            return None
        out = self._probe_processes(self.n_hosts, [str(self.n_hosts), json.dumps(items)], timeout_s)
        return json.loads(out)["gradient_exchange_s"]

    @property
    def key(self) -> str:
        return self.made.key

    @property
    def threads(self) -> int:
        """CPU threads per process: every emulated host sees all of this machine's cores, so
        ``hpar run`` would give each host's processes all of them, and H hosts would run H
        times too many threads (OpenMP's spinning threads then take turns on the cores; BENCHMARKS.md,
        "hpar bench on one machine and on two emulated hosts"). The cores are shared out
        instead: cpu_count over
        every worker and one server per host (hybrid's and ps's), at least 1."""
        return max(1, (os.cpu_count() or 1) // (self.n_hosts * (self.slots + 1)))

    def describe(self) -> dict:
        """The emulation for the JSON: hosts, slots, link rate and queue, threads per process, addresses."""
        return {
            "hosts": self.n_hosts,
            "workers_per_host": self.slots,
            "link_Bps": self.bandwidth_Bps,
            "link_queue": self.queue if self.bandwidth_Bps else None,
            "threads_per_process": self.threads,
            "root_qdisc": self.root_qdisc(),
            "addresses": self.made.addresses if self.made else [],
        }

    def root_qdisc(self) -> str | None:
        """The kind of the root queue on host 0's link as the kernel reports it (``tc qdisc
        show``: ``tbf`` for the first-in first-out queue, ``htb`` for the fair one), None before
        the hosts exist or without a cap."""
        if not self.made or not self.bandwidth_Bps:
            return None
        out = subprocess.run(
            ["ip", "netns", "exec", self.made.hosts[0].namespace, "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
        ).stdout
        root = next((line.split() for line in out.splitlines() if " root " in f" {line} "), None)
        return root[1] if root and len(root) > 1 else None

    def sample(self) -> Sample:
        """One reading of every host's counters."""
        ifs, ifr, tcp, pkts = {}, {}, {}, {}
        for h in self.made.hosts:
            # the root-namespace end of the host's veth receives what the host sends
            base = f"/sys/class/net/{h.veth}/statistics"
            ifs[h.address], ifr[h.address] = read_counter(f"{base}/rx_bytes"), read_counter(f"{base}/tx_bytes")
            pkts[h.address] = read_counter(f"{base}/rx_packets")
            now = socket_bytes(h.namespace)
            self._tcp[h.address] = self._tcp.get(h.address, 0) + socket_total(self._sockets.get(h.address, {}), now)
            self._sockets[h.address] = now
            tcp[h.address] = self._tcp[h.address]
        return Sample(time.time(), ifs, ifr, tcp, pkts)

    def around_run(self, run):
        """Call ``run()`` (a bench run returning a Result) while sampling counters; return
        (Result, the byte check of :func:`byte_check` or None when it could not be made)."""
        samples: list[Sample] = []
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                try:
                    samples.append(self.sample())
                except (OSError, ValueError):
                    pass
                stop.wait(SAMPLE_S)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            result = run()
        finally:
            stop.set()
            thread.join()
        check = byte_check(samples, result.run_dir) if result.reason is None and result.run_dir else None
        return result, check
