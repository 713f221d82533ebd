"""Glue between ``hpar run``'s flags and the SSH layer: build SSHOptions, run the preflight on
the hosts that get processes, print its table, and refuse (ValueError, one line) when any host
fails, so that nothing starts anywhere."""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console

from hpar.launcher.hosts.environ import describe
from hpar.launcher.hosts.hostfile import Host, place_workers
from hpar.launcher.hosts.preflight import preflight
from hpar.launcher.procs.ssh import SSHOptions


def ssh_options(
    *,
    ssh_key=None,
    ssh_port=None,
    ssh_user=None,
    ssh_local=False,
    python_path=None,
    connect_timeout: float = 10.0,
    retries: int = 2,
    known_hosts=None,
    accept_new=False,
) -> SSHOptions:
    """SSHOptions from the ``--ssh-*``/``--python`` flags. Raises ValueError for a missing key
    file or a port outside 1..65535."""
    import os

    if ssh_key is not None and not os.path.isfile(ssh_key):
        raise ValueError(f"--ssh-key: {ssh_key!r} is not a file; pass a private key file")
    if ssh_port is not None and not 1 <= ssh_port <= 65535:
        raise ValueError(f"--ssh-port: {ssh_port} is out of range (1..65535)")
    return SSHOptions(
        key=ssh_key,
        port=ssh_port,
        user=ssh_user,
        connect_timeout=connect_timeout,
        retries=retries,
        python=python_path,
        force_ssh=bool(ssh_local),
        known_hosts=known_hosts,
        accept_new=bool(accept_new),
    )


def prepare_remote(
    console: Console, hosts: tuple[Host, ...], cfg, flags, env: dict | None = None, master_port: int = 0
) -> tuple[SSHOptions, str]:
    """(SSHOptions carrying each host's interface, rendezvous address) for a run of ``cfg``
    over ``hosts``, after a passing preflight of the hosts that get workers. ``flags``: the
    SSH settings (launcher/run/flags.HostFlags: key, port, user, ssh_local, python_path, sync,
    known hosts). Prints the preflight table (or summary) and the names of the variables
    forwarded to the hosts (launcher/hosts/environ.py; ``env``: the ``--env`` values), and
    raises ValueError (one line naming every failed host) otherwise."""
    opts = ssh_options(
        ssh_key=flags.ssh_key,
        ssh_port=flags.ssh_port,
        ssh_user=flags.ssh_user,
        ssh_local=flags.ssh_local,
        python_path=flags.python_path,
        known_hosts=flags.ssh_known_hosts,
        accept_new=flags.ssh_accept_new,
    )
    sync = flags.sync
    used = list(dict.fromkeys(place_workers(list(hosts), cfg.world_size)))
    report = preflight(used, cfg.script, opts, master_port, sync=sync)
    if not report.ok:
        console.print(report.table())
        console.print(f"hpar: {describe(env)}", markup=False)
        raise ValueError(report.summary())
    console.print(f"hpar: {report.summary()}", markup=False)
    console.print(f"hpar: {describe(env)}", markup=False)
    return replace(opts, ifnames=report.ifnames, gpus={row.host: row.gpus for row in report.rows}), report.master_addr
