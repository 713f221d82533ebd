"""Opening an SSH connection to a host (fabric over paramiko): the options (:class:`SSHOptions`),
host keys checked against known_hosts as OpenSSH in batch mode does (``accept_new``:
``StrictHostKeyChecking=accept-new``), retries with backoff for refused or timed-out
connections but never for a failed authentication, TCP keepalives and ``TCP_USER_TIMEOUT``
so a dead link closes the channel within ``LINK_TIMEOUT_S`` s. Every failure is an
:class:`SSHError` with one line naming the host. The connection pool (ssh_pool.py) and the
remote processes (ssh.py) build on this module; it imports neither.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field

import fabric
import paramiko

from hpar.launcher.hosts.hostfile import Host

LINK_TIMEOUT_S = 3.0


class SSHError(RuntimeError):
    """A host cannot be reached or refused us; the message is one line naming the host."""


@dataclass(frozen=True)
class SSHOptions:
    """How to reach hosts: ``key`` (private key file; None: ~/.ssh/config, agent and default
    keys), ``port``/``user`` (defaults when a host entry gives none), ``connect_timeout``
    (seconds per attempt), ``retries`` (extra attempts, with backoff 0.5 s, 1 s, 2 s, ...),
    ``python`` (interpreter on the hosts; None: the launcher's ``sys.executable``), and
    ``force_ssh`` (use SSH even for this machine's entries: ``--ssh-local``), ``known_hosts`` and
    ``accept_new`` (host key checking, see :func:`known_hosts_file`), and ``ifnames``
    (host name -> the interface reaching the rendezvous host, from preflight: set as
    GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unless the spec sets them)."""

    key: str | None = None
    port: int | None = None
    user: str | None = None
    connect_timeout: float = 10.0
    retries: int = 2
    python: str | None = None
    force_ssh: bool = False
    ifnames: dict = field(default_factory=dict)  # host name -> interface (from preflight)
    gpus: dict = field(default_factory=dict)  # host name -> GPUs it sees (from preflight)
    known_hosts: str | None = None  # None: $HPAR_SSH_KNOWN_HOSTS, else ~/.ssh/known_hosts
    accept_new: bool = False  # record unknown host keys (StrictHostKeyChecking=accept-new)


def known_hosts_file(opts: SSHOptions) -> str:
    """The known_hosts file host keys are checked against: ``opts.known_hosts``, else
    ``$HPAR_SSH_KNOWN_HOSTS``, else ``~/.ssh/known_hosts`` (OpenSSH's)."""
    return os.path.expanduser(opts.known_hosts or os.environ.get("HPAR_SSH_KNOWN_HOSTS") or "~/.ssh/known_hosts")


_known_lock = threading.Lock()


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """What to do with a host key not in known_hosts. OpenSSH in batch mode refuses it, and so
    does hpar by default (fabric's AutoAddPolicy would accept any key, so a first connection
    could be intercepted); with ``accept_new`` the key is appended to the file, as
    ``StrictHostKeyChecking=accept-new`` does. A key that differs from the recorded one is
    refused by paramiko itself (BadHostKeyException) in both cases."""

    def __init__(self, path: str, accept_new: bool):
        self.path, self.accept_new = path, accept_new

    def missing_host_key(self, client, hostname, key) -> None:
        if not self.accept_new:
            raise SSHError(
                f"host {hostname}: its {key.get_name()} host key is not in {self.path}; check it and rerun "
                "with --ssh-accept-new to record it (or add it with `ssh-keyscan`)"
            )
        with _known_lock:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


def _check_host_keys(conn: fabric.Connection, opts: SSHOptions) -> None:
    path = known_hosts_file(opts)
    if os.path.exists(path):
        try:
            conn.client.get_host_keys().load(path)
        except (OSError, paramiko.SSHException) as exc:
            raise SSHError(f"{path}: cannot read the known hosts ({exc}); fix or remove the file") from None
    conn.client.set_missing_host_key_policy(_HostKeyPolicy(path, opts.accept_new))


def connect(host: Host, opts: SSHOptions) -> fabric.Connection:
    """An open fabric Connection to ``host`` (key-based; honours ~/.ssh/config; host entry's
    user/port win over the options'; the host key checked against known_hosts). Retries refused or timed-out connections ``opts.retries``
    times with backoff, never a failed authentication. Raises SSHError (one line) on failure."""
    connect_kwargs: dict = {"banner_timeout": opts.connect_timeout, "auth_timeout": opts.connect_timeout}
    if opts.key:
        if not os.path.isfile(opts.key):
            raise SSHError(f"--ssh-key: {opts.key!r} is not a file")
        connect_kwargs.update(key_filename=[opts.key], look_for_keys=False, allow_agent=False)
    conn = fabric.Connection(
        host.name,
        user=host.user or opts.user,
        port=host.port or opts.port,
        connect_timeout=opts.connect_timeout,
        connect_kwargs=connect_kwargs,
    )
    where = f"{conn.user}@{host.name}:{conn.port}"
    _check_host_keys(conn, opts)
    for attempt in range(opts.retries + 1):
        try:
            conn.open()
            _keepalive(conn)
            return conn
        except SSHError:
            conn.close()
            raise
        except paramiko.BadHostKeyException:
            conn.close()
            raise SSHError(
                f"host {where}: its host key differs from the one in {known_hosts_file(opts)} (the host "
                "was reinstalled, or the connection is intercepted); check it, then remove the old "
                f"entry with `ssh-keygen -R {host.name}`"
            ) from None
        except paramiko.AuthenticationException as e:
            conn.close()
            raise SSHError(f"host {where}: authentication failed ({e}); check --ssh-key/--ssh-user") from None
        except (OSError, paramiko.SSHException, EOFError) as e:
            conn.close()
            problem = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if attempt == opts.retries:
                raise SSHError(f"host {where}: unreachable after {opts.retries + 1} attempts ({problem})") from None
            time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def _keepalive(conn: fabric.Connection) -> None:
    transport = conn.client.get_transport()
    assert transport is not None
    transport.set_keepalive(1)
    sock = transport.sock
    if isinstance(sock, socket.socket) and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(LINK_TIMEOUT_S * 1000))


__all__ = ["LINK_TIMEOUT_S", "SSHError", "SSHOptions", "known_hosts_file", "connect"]
