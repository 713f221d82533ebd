"""Where a run's processes meet and what they compute on: rank 0's address (its host under Slurm
or on Ray, else the SSH preflight's answer, or this machine) and the device every worker uses,
chosen from the GPUs each host has (launcher/run/device_choice.py)."""

from __future__ import annotations

import os

from rich.console import Console

from hpar.launcher.hosts.environ import describe as describe_env
from hpar.launcher.hosts.hostfile import place_workers
from hpar.launcher.run.device_choice import choose_devices, describe, local_gpus
from hpar.strategies.job.config import RunConfig


def rank0_address(
    console: Console,
    cfg: RunConfig,
    host_list: tuple,
    host_flags,
    slurm: bool,
    ray: bool,
    extra_env: dict,
    remote_ready=None,
) -> tuple[object, str]:
    """``(SSHOptions or None, rendezvous address)`` of ``cfg``'s run on ``host_list``: under Slurm
    or on Ray rank 0's host (on Ray: its node's address as Ray reports it, never the driver's);
    over SSH the preflight's (``remote_ready`` where it already ran); else this machine.
    ``host_flags``: launcher/run/flags.HostFlags; ``extra_env``: the forwarded environment."""
    ssh_opts, master = None, "127.0.0.1"
    if slurm or ray:
        from hpar.launcher.hosts.preflight import resolve_master

        master = resolve_master(place_workers(list(host_list), cfg.world_size))
        console.print(f"hpar: {describe_env(extra_env)}", markup=False)
    elif host_list and (host_flags.ssh_local or any(not host.is_local for host in host_list)):
        from hpar.launcher.hosts.remote import prepare_remote

        ssh_opts, master = remote_ready or prepare_remote(console, host_list, cfg, host_flags, env=extra_env)
    return ssh_opts, master


def run_device(
    console: Console, cfg: RunConfig, host_list: tuple, ssh_opts, slurm: bool, ray: bool, device: str
) -> tuple[RunConfig, list]:
    """``(cfg with its device chosen, the hosts that get workers)``: ``device`` (``--device``) on
    the GPUs each host has (as SSH's preflight, Slurm or Ray report them; this machine's
    otherwise), printed as one line."""
    seen = getattr(ssh_opts, "gpus", None) or {}
    if slurm and os.environ.get("SLURM_GPUS_ON_NODE", "").isdigit():  # Slurm's count for every node
        seen = {h.name: int(os.environ["SLURM_GPUS_ON_NODE"]) for h in host_list}
    seen = {h.name: h.gpus for h in host_list} if ray else seen  # the GPUs Ray reports per node
    hosts_used = place_workers(list(host_list), cfg.world_size) if host_list else []
    rows = [
        (n, sum(1 for h in hosts_used if h.name == n), seen.get(n, local_gpus()))
        for n in dict.fromkeys(h.name for h in hosts_used)
    ] or [("localhost", cfg.world_size, local_gpus())]
    chosen, per_host = choose_devices(rows, device)
    cfg = cfg.replace(device=chosen)
    console.print(f"hpar: {describe(chosen, per_host, cfg.servers)}", markup=False)
    return cfg, hosts_used
