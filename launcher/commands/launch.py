"""``hpar launch SCRIPT [ARGS]...``: run any torchrun-style script (one that calls
``init_process_group`` itself), unmodified, on every slot of every host, with torchrun's
environment variables and the script's arguments passed through (launcher/run/scripts.py).

hpar cannot profile such a script (it has no ``model()``/``data()``/``loss()`` to measure) and
says so; a script that follows hpar's contract is refused with a hint to use ``hpar run``,
which profiles it and picks a strategy. Both are told apart from the source (``ast``), without
importing the script.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import click
from rich.console import Console

from hpar.launcher.run.script_kind import script_kind


def resolve(console: Console, script: str, args: tuple, flags, run_dir: str | None, max_restarts: int, plain: bool):
    """(ScriptRun, LaunchOptions, rendezvous address), or ValueError (one line) before
    anything starts. ``flags``: where to run (launcher/run/flags.HostFlags: --gpus, --hosts,
    SSH, --env, --sync)."""
    gpus, hosts = flags.gpus, flags.hosts
    from hpar.launcher.hosts.environ import describe, parse_env_flags
    from hpar.launcher.hosts.hostfile import place_workers, total_slots
    from hpar.launcher.hosts.ray_nodes import cluster_hosts, describe as describe_ray, is_ray
    from hpar.launcher.hosts.slurm import allocation_hosts, describe as describe_allocation, in_allocation
    from hpar.launcher.run.rundir import default_run_dir
    from hpar.launcher.run.runner import LaunchOptions
    from hpar.launcher.run.scripts import ScriptRun

    kind = script_kind(script)
    if kind == "contract":
        raise ValueError(
            f"{script} follows hpar's contract (model, data, loss): run it with `hpar run {script} "
            f"--gpus N`, which profiles it and picks a strategy (`hpar launch` is for scripts that "
            f"call init_process_group themselves)"
        )
    extra_env = parse_env_flags(flags.env)
    if max_restarts < 0:
        raise ValueError("--max-restarts must not be negative")
    host_list = tuple(cluster_hosts(hosts)) if hosts else ()  # a Ray cluster's nodes for --hosts ray
    ray = is_ray(host_list)
    if ray:
        console.print(f"hpar: {describe_ray(list(host_list))}", markup=False)
    slurm = not host_list and in_allocation()
    if slurm:
        host_list = tuple(allocation_hosts())
        console.print(f"hpar: {describe_allocation(list(host_list))}", markup=False)
    if gpus is None:
        gpus = total_slots(list(host_list)) if host_list else 1
    if gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {gpus}")
    if host_list:
        place_workers(list(host_list), gpus)
    run = ScriptRun(
        script=os.path.abspath(script),
        args=tuple(args),
        world_size=gpus,
        run_dir=os.path.abspath(run_dir or default_run_dir()),
    )
    if os.path.exists(os.path.join(run.run_dir, "config.json")):
        raise ValueError(f"--run-dir {run.run_dir} already holds a run; pick a new directory")
    from hpar.launcher.run.validate import check_run_dir

    check_run_dir(run.run_dir)
    console.print(
        f"hpar: launching {os.path.basename(script)} as it is on {gpus} process(es) "
        f"(no profiling: hpar cannot profile a script that starts its own process group)",
        markup=False,
    )
    ssh_opts, master = None, "127.0.0.1"
    if slurm:
        from hpar.launcher.hosts.preflight import resolve_master

        master = resolve_master(place_workers(list(host_list), gpus))
        console.print(f"hpar: {describe(extra_env)}", markup=False)
    elif ray:  # rank 0's node as Ray reports it
        master = place_workers(list(host_list), gpus)[0].name
        console.print(f"hpar: {describe(extra_env)}", markup=False)
    elif host_list and (flags.ssh_local or any(not h.is_local for h in host_list)):
        from hpar.launcher.hosts.remote import prepare_remote

        ssh_opts, master = prepare_remote(console, host_list, run, flags, env=extra_env)
    opts = LaunchOptions(
        hosts=host_list,
        ssh=ssh_opts,
        max_restarts=max_restarts,
        live=False if plain else None,
        sync=flags.sync,
        env=extra_env,
        slurm=slurm,
        ray=ray,
    )
    return run, opts, master


@click.command(
    context_settings={
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
    }
)
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "--gpus",
    type=int,
    default=None,
    help="Processes (default: every slot of --hosts or of the Slurm allocation, else 1).",
)
@click.option(
    "--hosts",
    default=None,
    help="Host file or inline list 'a:2,b:2', or ray / ray://HEAD:10001 (a Ray cluster's "
    "nodes); default this machine (or the Slurm allocation).",
)
@click.option(
    "--run-dir",
    default=None,
    help="Run directory for logs and the summary (default runs/<timestamp>); "
    "a new or empty one, made readable by you only.",
)
@click.option(
    "--group-readable",
    is_flag=True,
    help="Make a new run directory readable (never writable) by your group: mode 0750 instead of 0700.",
)
@click.option(
    "--max-restarts",
    type=int,
    default=0,
    show_default=True,
    help="Start every rank again after a failure, at most N times.",
)
@click.option("--plain", is_flag=True, help="Plain output lines even on a terminal.")
@click.option("--env", "env", multiple=True, metavar="KEY[=VALUE]", help="Also give remote processes KEY; repeatable.")
@click.option("--ssh-key", default=None, help="SSH private key file.")
@click.option("--ssh-port", type=int, default=None, help="SSH port.")
@click.option("--ssh-user", default=None, help="SSH user.")
@click.option("--ssh-local", is_flag=True, help="Use SSH even for localhost entries.")
@click.option("--python", "python_path", default=None, help="Interpreter on the hosts (default: this one's path).")
@click.option("--sync", is_flag=True, help="Copy the script to hosts that lack it.")
def launch(script, args, run_dir, max_restarts, plain, group_readable, **hosts):
    """Run a torchrun-style SCRIPT (it calls init_process_group itself) with ARGS on every
    slot, under hpar's supervision. hpar's options go before SCRIPT; everything after it is
    the script's."""
    from hpar.launcher.usage import fail

    console = Console(soft_wrap=True)
    try:
        from hpar.launcher.run.flags import HostFlags

        run, opts, master = resolve(console, script, args, HostFlags(**hosts), run_dir, max_restarts, plain)
        opts = replace(opts, group_readable=group_readable)
    except ValueError as exc:
        fail(str(exc))
    from hpar.launcher.run.scripts import run_script

    outcome = run_script(run, opts, console, master)
    if outcome.exit_code == 0:
        console.print(
            f"hpar: done: {run.world_size} process(es) exited 0 in {outcome.summary['wall_s']:.1f} s; "
            f"run dir {run.run_dir}",
            markup=False,
        )
    sys.exit(outcome.exit_code)
