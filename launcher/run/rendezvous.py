"""The rendezvous of a run: where its store listens (MASTER_ADDR:MASTER_PORT), on a port that
two runs started at once on the same hosts never share, and which interface gloo and NCCL use.

- When the first host is this machine, the launcher itself hosts the rendezvous store, as
  torchrun's agent does: a ``torch.distributed.TCPStore`` server on a port the kernel picks
  (or the one ``HPAR_MASTER_PORT`` asks for, when it is free), held for the whole attempt, and
  every process gets ``TORCHELASTIC_USE_AGENT_STORE=True`` so that rank 0 joins it as a client
  instead of binding the port itself. No other process can take the port between the choice
  and its use, because it is never released in between.
- Otherwise (the first host is remote) the port is one that was free a moment ago
  (``HPAR_MASTER_PORT`` or a free port) and rank 0's guard holds the store there
  (``HPAR_HOLD_STORE=1``, workers/store.py ``guard_store``; every rank a client as above);
  when it fails with EADDRINUSE, :func:`port_taken` says so and the launcher starts the attempt
  again on another port (``MAX_PORT_RETRIES`` times, not counted as a restart).

Where it listens: the store on MASTER_ADDR only, never the wildcard address torch's own
store takes (workers/store.py): 127.0.0.1 when every process is on this machine, else the
first host's address on the hosts' network (launcher/hosts/preflight.py ``resolve_master``).
When every process is on this machine, every process also gets ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` naming the loopback interface, so that gloo does not listen on what the
host name resolves to (often the LAN address) nor NCCL on its first interface; they win over
the launcher's inherited environment (a cluster-wide export must not open a one-machine run to
the network) but not over ``--env`` (a choice made for this run). Multi-host runs get the
interface that reaches the first host from the preflight (launcher/procs/ssh.py ``make_process``).

Source: torch.distributed.elastic's agent store (``TORCHELASTIC_USE_AGENT_STORE``,
torch/distributed/rendezvous.py ``_create_c10d_store``); torch docs, "Choosing the network
interface to use"; NCCL docs, ``NCCL_SOCKET_IFNAME``.
"""

from __future__ import annotations

import os

from hpar.strategies.plan.cluster import free_port
from hpar.workers.store import HOLD_STORE, hold_store, is_loopback, loopback_interface

MAX_PORT_RETRIES = 3
_IN_USE = ("EADDRINUSE", "address already in use", "Address already in use")
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class Rendezvous:
    """One attempt's rendezvous endpoint: ``master`` (the address the store listens on and
    every process connects to), ``port``, ``hosted`` (the launcher holds the store) and
    ``env`` (variables every process gets: see the module docstring). ``user_env``: the
    ``--env`` values, which keep their interface variables. Use as a context manager;
    ``close()`` drops the store. Raises OSError when no port can be bound here."""

    def __init__(
        self, master: str, first_host_local: bool, avoid: "set[int] | None" = None, user_env: "dict | None" = None
    ):
        self.master = master
        self.hosted = first_host_local
        self._store = None
        avoid = avoid or set()
        wanted = int(os.environ.get("HPAR_MASTER_PORT", "0") or 0)
        if self.hosted:
            for port in ([wanted] if wanted and wanted not in avoid else []) + [0] * MAX_PORT_RETRIES:
                try:
                    self._store = hold_store(master, port)  # on ``master`` only (workers/store.py)
                except (RuntimeError, OSError):  # EADDRINUSE on a wanted port: take the kernel's pick
                    continue
                if self._store.port in avoid:
                    self._store = None
                    continue
                break
            if self._store is None:
                raise OSError(f"could not bind a rendezvous port on {master} on this machine")
            self.port = self._store.port
            self.env = {"TORCHELASTIC_USE_AGENT_STORE": "True", HOLD_STORE: ""}
        else:
            self.port = wanted if wanted and wanted not in avoid else free_port("")
            while self.port in avoid:
                self.port = free_port("")
            self.env = {"TORCHELASTIC_USE_AGENT_STORE": "True", HOLD_STORE: "1"}
        self.interfaces: dict[str, str] = {}  # variable -> interface, and where it comes from
        if is_loopback(master):  # every process on this machine
            given = user_env or {}
            loopback = loopback_interface()
            for name in IFNAME_VARIABLES:
                if name in given:
                    self.interfaces[name] = f"{given[name]} (--env)"
                else:
                    self.env[name] = loopback
                    self.interfaces[name] = loopback

    def describe(self) -> str:
        """One line: where the store listens, who holds it, and (every process on this machine)
        the interface gloo and NCCL use."""
        held = "held by the launcher" if self.hosted else "bound by rank 0's guard"
        line = f"rendezvous at {self.master}:{self.port} ({held}, listening on {self.master} only)"
        if self.interfaces:
            names = set(self.interfaces.values())
            line += (
                "; gloo and NCCL on " + names.pop()
                if len(names) == 1
                else "; " + ", ".join(f"{k}={v}" for k, v in self.interfaces.items())
            )
        return line

    def close(self) -> None:
        self._store = None

    def __enter__(self) -> "Rendezvous":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def port_taken(rundir, procs) -> bool:
    """True when a process's last log lines say that the rendezvous port was in use."""
    for p in procs:
        if any(word in line for line in rundir.tail(p.spec.log_name, 20) for word in _IN_USE):
            return True
    return False


def first_host_local(hosts) -> bool:
    """True when the first host of a run (where rank 0 and the rendezvous are) is this
    machine; no host list means this machine only."""
    return not hosts or hosts[0].is_local
