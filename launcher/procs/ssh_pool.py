"""One SSH connection per host, shared: the preflight's check, every process started on the
host (one channel each) and the teardown's command (launcher/procs/ssh_control.py) go over it,
so a host costs one TCP connection, key exchange and authentication, not one per process and
per teardown round (OpenSSH's ControlMaster idea, with paramiko's transport as the master).

A connection carries at most ``MAX_PROCESSES`` process channels (OpenSSH's sshd allows 10
sessions per connection by default, ``MaxSessions``; the rest is left for control commands);
a host with more processes gets a second connection, and so on. A connection that broke is
replaced on the next use.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from hpar.launcher.procs.ssh_connect import connect

MAX_PROCESSES = 8

_lock = threading.Lock()
_host_locks: dict[tuple, threading.Lock] = {}
_pool: dict[tuple, list] = {}  # key -> [_Shared, ...]


@dataclass
class _Shared:
    conn: object  # fabric.Connection
    processes: int = 0  # process channels handed out on it


def _key(host, opts) -> tuple:
    return (host.name, host.user or opts.user, host.port or opts.port, opts.key, opts.known_hosts, opts.accept_new)


def _active(conn) -> bool:
    transport = conn.client.get_transport() if conn.is_connected else None
    return transport is not None and transport.is_active() and transport.is_authenticated()


def connection(host, opts, for_process: bool = False):
    """An open fabric Connection to ``host`` (launcher/procs/ssh_connect.py's ``connect``: host keys
    checked, keepalives set), shared with every other user of the same host and options.
    ``for_process``: the caller opens a long-lived process channel on it (counted against
    ``MAX_PROCESSES``). Raises SSHError (one line) when the host cannot be reached."""
    key = _key(host, opts)
    with _lock:
        host_lock = _host_locks.setdefault(key, threading.Lock())
    with host_lock:  # one handshake per host at a time; other hosts go on in parallel
        shared = [s for s in _pool.get(key, []) if _active(s.conn)]
        room = [s for s in shared if not for_process or s.processes < MAX_PROCESSES]
        if room:
            chosen = room[0]
        else:
            chosen = _Shared(connect(host, opts))
            shared.append(chosen)
        _pool[key] = shared
        if for_process:
            chosen.processes += 1
        return chosen.conn


def forget(conn) -> None:
    """Close ``conn`` and drop it from the pool (the next user makes a new one)."""
    with _lock:
        for key, shared in _pool.items():
            _pool[key] = [s for s in shared if s.conn is not conn]
    conn.close()
