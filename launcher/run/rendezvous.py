"""The rendezvous port of a run (MASTER_PORT), chosen so that two runs started at once on the
same hosts never share one.

- When the first host is this machine, the launcher itself hosts the rendezvous store, as
  torchrun's agent does: a ``torch.distributed.TCPStore`` server bound to a port the kernel
  picks (or the one ``HPAR_MASTER_PORT`` asks for, when it is free), held for the whole
  attempt, and every process gets ``TORCHELASTIC_USE_AGENT_STORE=True`` so that rank 0 joins
  it as a client instead of binding the port itself. No other process can take the port
  between the choice and its use, because it is never released in between.
- Otherwise (the first host is remote) the port is one that was free a moment ago
  (``HPAR_MASTER_PORT`` or a free port) and rank 0 binds it; when it fails with EADDRINUSE,
  :func:`port_taken` says so and the launcher starts the attempt again on another port
  (``MAX_PORT_RETRIES`` times, not counted as a restart).

Source: torch.distributed.elastic's agent store (``TORCHELASTIC_USE_AGENT_STORE``,
torch/distributed/rendezvous.py ``_create_c10d_store``).
"""
from __future__ import annotations

import datetime
import os

from hpar.strategies.plan.cluster import free_port

MAX_PORT_RETRIES = 3
_IN_USE = ("EADDRINUSE", "address already in use", "Address already in use")


class Rendezvous:
    """One attempt's rendezvous endpoint: ``port``, ``hosted`` (the launcher holds the store)
    and ``env`` (variables every process gets). Use as a context manager; ``close()`` drops
    the store. Raises OSError when no port can be bound here."""

    def __init__(self, master: str, first_host_local: bool, avoid: "set[int] | None" = None):
        self.master = master
        self.hosted = first_host_local
        self._store = None
        avoid = avoid or set()
        wanted = int(os.environ.get("HPAR_MASTER_PORT", "0") or 0)
        if self.hosted:
            from torch.distributed import TCPStore
            bind = "127.0.0.1" if master == "127.0.0.1" else "0.0.0.0"
            for port in ([wanted] if wanted and wanted not in avoid else []) + [0] * MAX_PORT_RETRIES:
                try:
                    self._store = TCPStore(bind, port, is_master=True, wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=60))
                except (RuntimeError, OSError):  # EADDRINUSE on a wanted port: take the kernel's pick
                    continue
                if self._store.port in avoid:
                    self._store = None
                    continue
                break
            if self._store is None:
                raise OSError("could not bind a rendezvous port on this machine")
            self.port = self._store.port
            self.env = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
        else:
            self.port = wanted if wanted and wanted not in avoid else free_port("")
            while self.port in avoid:
                self.port = free_port("")
            self.env = {}

    def describe(self) -> str:
        held = "held by the launcher" if self.hosted else "bound by rank 0"
        return f"rendezvous at {self.master}:{self.port} ({held})"

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
