"""Hosts from a Ray cluster: ``--hosts ray`` (the address ``ray.init`` takes from ``RAY_ADDRESS``:
the head's GCS address ``HOST:6379`` on a cluster node, or ``auto``) and ``--hosts ray://HOST:10001``
(Ray Client, from a machine outside the cluster). hpar connects as a Ray driver and reads the
alive nodes into the same :class:`Host` list a host file or a Slurm allocation gives, so the
planner and the placement of ranks are unchanged; processes then start through Ray
(launcher/procs/ray_actor.py), never over SSH.

- A node is a host named by its Ray-reported IP (``NodeManagerAddress``: the address every
  other node reaches it on, which the rendezvous and gloo then use). Its slots are its GPUs, or 1
  on a node without GPUs (one worker that uses the node's cores, as a Slurm node without GPUs
  gets). Nodes without CPUs (a head started with ``--num-cpus 0``) run nothing and are left out.
- Order: the node this launcher runs on first when it is one (rank 0 and the rendezvous there),
  then the others by IP, so that the same cluster gives the same placement.
- Ray is imported only here and in the process engine; without it ``--hosts ray`` is refused in
  one line naming the install. ``RAY_USAGE_STATS_ENABLED=0`` is set before the import.

Source: Ray's ``ray.init`` (address resolution), ``ray.nodes()`` (the node table).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from hpar.launcher.hosts.hostfile import Host, parse_hosts

INSTALL = "pip install 'hpar[ray]'"


@dataclass(frozen=True)
class RayHost(Host):
    """A Ray node as a host: ``name`` is its IP; ``cpus``, ``gpus`` and ``memory_bytes`` are
    what Ray reports it has; ``node_id`` is Ray's id (hex). Never "local": its processes always
    start through Ray, even on the node the launcher runs on."""

    cpus: float = 0.0
    gpus: int = 0
    memory_bytes: int = 0
    node_id: str = ""

    @property
    def is_local(self) -> bool:
        return False


def is_ray(spec) -> bool:
    """Whether ``--hosts SPEC`` names a Ray cluster (``ray`` or ``ray://HOST:PORT``), or is a
    host list read from one."""
    if isinstance(spec, (list, tuple)):
        return bool(spec) and all(isinstance(h, RayHost) for h in spec)
    return isinstance(spec, str) and (spec.strip() == "ray" or spec.strip().startswith("ray://"))


def import_ray():
    """``ray``, imported with usage reporting off; ValueError (one line) when it is not installed."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        raise ValueError(f"--hosts ray: Ray is not installed here; {INSTALL}") from None
    return ray


def connect(spec: str = "ray", attempts: int = 3):
    """Connect this process to the Ray cluster of ``--hosts SPEC`` as a driver (once; later calls
    reuse the connection) and return ``ray``. ``ray`` takes ``RAY_ADDRESS`` (default ``auto``: the
    cluster this node belongs to), ``ray://HOST:PORT`` is Ray Client. Ray Client's server starts one
    process per client and can fail that start on a loaded head ("Initialization failure from
    server"); such a refusal is retried up to ``attempts`` times, 2 s apart. Raises ValueError (one
    line, the server's last line of reason) when Ray is missing or the cluster cannot be reached."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    address = spec.strip() if spec.strip().startswith("ray://") else (os.environ.get("RAY_ADDRESS") or "auto")
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False, namespace="hpar")
            return ray
        except ConnectionAbortedError as exc:  # the client server refused this start: try again
            reason = exc
            ray.shutdown()
            if attempt < attempts:
                time.sleep(2.0)
        except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
            reason = exc
            break
    lines = [line.strip() for line in str(reason).strip().splitlines() if line.strip()]
    why = lines[0].rstrip(":") if lines else type(reason).__name__
    if len(lines) > 1:
        why = f"{why}: {lines[-1]}"
    raise ValueError(
        f"--hosts {spec}: cannot connect to the Ray cluster at {address} ({why}); start one with "
        "`ray start --head`, or set RAY_ADDRESS to its head's HOST:6379, or pass "
        "--hosts ray://HEAD:10001"
    ) from None


def node_hosts(nodes: list[dict], here: str | None = None) -> list[RayHost]:
    """The alive nodes of ``ray.nodes()`` as hosts (module docstring), ``here`` (this machine's
    Ray IP, when it is a node) first. Raises ValueError when no node can run a process."""
    hosts = []
    for node in nodes:
        res = node.get("Resources") or {}
        if not node.get("Alive") or res.get("CPU", 0) <= 0:
            continue
        gpus = int(res.get("GPU", 0))
        hosts.append(
            RayHost(
                name=node["NodeManagerAddress"],
                slots=gpus or 1,
                cpus=float(res.get("CPU", 0)),
                gpus=gpus,
                memory_bytes=int(res.get("memory", 0)),
                node_id=node.get("NodeID", ""),
            )
        )
    if not hosts:
        raise ValueError("--hosts ray: the Ray cluster has no alive node with CPUs (`ray status` shows its nodes)")
    hosts.sort(
        key=lambda h: (h.name != here, tuple(int(p) if p.isdigit() else p for p in h.name.replace(":", ".").split(".")))
    )
    return hosts


def ray_hosts(spec: str = "ray") -> list[RayHost]:
    """The hosts of the Ray cluster ``--hosts SPEC`` names (connecting first). Raises ValueError."""
    ray = connect(spec)
    try:
        here = ray.util.get_node_ip_address() if not spec.strip().startswith("ray://") else None
    except Exception:  # a driver outside the cluster has no node of its own
        here = None
    return node_hosts(ray.nodes(), here)


def cluster_hosts(spec) -> list[Host]:
    """The hosts of ``--hosts SPEC``: the nodes of a Ray cluster for ``ray``/``ray://...``
    (:func:`ray_hosts`), else launcher/hosts/hostfile.py's ``parse_hosts``. Raises ValueError."""
    return ray_hosts(spec.strip()) if is_ray(spec) and isinstance(spec, str) else parse_hosts(spec)


def gone(hosts) -> dict[str, str]:
    """Host name -> why it cannot run processes now ("" when it can), from the cluster's node
    table read again (``--min-hosts`` restarts: launcher/run/elastic.py)."""
    ray = import_ray()
    alive = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    return {h.name: "" if h.name in alive else "not an alive node of the Ray cluster any more" for h in hosts}


def describe(hosts: list[RayHost]) -> str:
    """One line: the nodes, their slots, CPUs and GPUs."""
    shown = ", ".join(f"{h.name}:{h.slots} ({h.cpus:g} CPU{', %d GPU' % h.gpus if h.gpus else ''})" for h in hosts[:8])
    more = f", ... ({len(hosts)} nodes)" if len(hosts) > 8 else ""
    return f"Ray cluster: nodes {shown}{more}; processes start as Ray actors"
