"""A first look at the hosts, before hpar spends a minute profiling: every host name resolves
and its SSH port accepts a TCP connection. Seconds at most (the hosts at once, a short timeout
each), so that a typo is named in one line; ``hpar run`` then runs the full preflight
(launcher/hosts/preflight.py: SSH login, versions, GPUs, the script) before profiling too, and
``hpar launch`` before it starts anything.

A host that ``~/.ssh/config`` reaches through ``ProxyJump`` or ``ProxyCommand`` is left to the
preflight (its name may resolve only on the jump host); a ``HostName`` there is what is
resolved, as OpenSSH would.
"""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor

from hpar.launcher.hosts.hostfile import Host

CONNECT_TIMEOUT_S = 3.0


def _ssh_config(name: str) -> dict:
    """``~/.ssh/config``'s settings for host ``name`` (paramiko's reading of it; {} without one)."""
    path = os.path.expanduser("~/.ssh/config")
    if not os.path.isfile(path):
        return {}
    import paramiko

    try:
        return paramiko.SSHConfig.from_path(path).lookup(name)
    except Exception:  # a config paramiko cannot read is OpenSSH's to judge, at the preflight
        return {}


def _problem(host: Host, ssh_port: int | None) -> str | None:
    """Why ``host`` cannot be reached over SSH, or None (also when only the preflight can tell)."""
    config = _ssh_config(host.name)
    if "proxyjump" in config or "proxycommand" in config:
        return None
    name = config.get("hostname", host.name)
    port = host.port or ssh_port or int(config.get("port", 22))
    try:
        address = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)[0][4]
    except socket.gaierror:
        return f"host name {host.name!r} does not resolve; fix the name in --hosts or use its address"
    try:
        socket.create_connection(address[:2], timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        why = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
        return f"{host.name} port {port} ({address[0]}): cannot connect ({why}); is the host up and its sshd listening?"
    return None


def check_reachable(hosts: "list[Host] | tuple[Host, ...]", ssh_port: int | None = None) -> None:
    """ValueError (one line naming the first failing host) unless every remote host of
    ``hosts`` resolves and accepts a TCP connection on its SSH port (the entry's, else
    ``ssh_port`` (--ssh-port), else ~/.ssh/config's, else 22); this machine's entries are
    skipped. All hosts are tried at once: at most ~CONNECT_TIMEOUT_S seconds in all."""
    remote = [h for h in dict.fromkeys(hosts) if not h.is_local]
    if not remote:
        return
    with ThreadPoolExecutor(max_workers=min(64, len(remote))) as pool:
        problems = list(pool.map(lambda h: _problem(h, ssh_port), remote))
    for problem in problems:
        if problem is not None:
            raise ValueError(f"--hosts: {problem}")


__all__ = ["check_reachable", "CONNECT_TIMEOUT_S"]
