"""``hpar launch``'s run: any torchrun-style script (one that calls ``init_process_group``
itself) on every slot of every host, under hpar's supervision (preflight, guard, per-rank
logs, live view, fail-fast teardown, restarts), without profiling.

Every process gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID, and OMP_NUM_THREADS
= this host's cores / its processes unless set), so ``init_process_group("gloo"|"nccl")`` with
the default ``env://`` works unmodified. Logs go to ``RUN_DIR/logs/rank-<r>.log``; the guard
reports each rank's CPU, memory and GPU memory (``HPAR_GUARD_STATS``) for the live view.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from dataclasses import asdict, dataclass

from rich.console import Console

from hpar.launcher.hosts.hostfile import Host, place_workers
from hpar.launcher.procs.local import LocalProcess, ProcessSpec
from hpar.launcher.run.progress import STOPPED_BY, Progress
from hpar.launcher.run.rendezvous import MAX_PORT_RETRIES, Rendezvous, first_host_local, port_taken
from hpar.launcher.run.rundir import RunDir
from hpar.launcher.run.runner import release
from hpar.launcher.run.supervisor import Outcome, Supervisor
from hpar.strategies.state.checkpoint import atomic_write_bytes

STATS_S = 2.0


@dataclass(frozen=True)
class ScriptRun:
    """What ``hpar launch`` runs: ``script`` (absolute path) with ``args``, on ``world_size``
    processes, logging to ``run_dir``."""

    script: str
    args: tuple[str, ...]
    world_size: int
    run_dir: str


def script_specs(
    run: ScriptRun,
    hosts: "tuple[Host, ...]",
    master: str,
    port: int,
    restart: int,
    max_restarts: int,
    python: str | None = None,
) -> list[ProcessSpec]:
    """One ProcessSpec per rank (role "rank"), placed on ``hosts`` in order (all on
    "localhost" without hosts), with torchrun's environment (see the module docstring)."""
    python = python or sys.executable
    names = [h.name for h in place_workers(list(hosts), run.world_size)] if hosts else ["localhost"] * run.world_size
    order = list(dict.fromkeys(names))
    run_id = os.path.basename(run.run_dir.rstrip("/"))
    specs = []
    for rank, host in enumerate(names):
        local = [r for r, h in enumerate(names) if h == host]
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local.index(rank)),
            "WORLD_SIZE": str(run.world_size),
            "LOCAL_WORLD_SIZE": str(len(local)),
            "GROUP_RANK": str(order.index(host)),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(run.world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            "HPAR_CONFIG": os.path.join(run.run_dir, "config.json"),
            "HPAR_GUARD_STATS": str(STATS_S),
            "PYTHONUNBUFFERED": "1",
        }
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // len(local)))
        argv = (python, "-m", "hpar.workers.guard", python, "-u", run.script, *run.args)
        specs.append(ProcessSpec("rank", rank, host, argv, env))
    return specs


def _processes(specs: list[ProcessSpec], opts, rundir: RunDir, lines: "queue.Queue") -> list:
    if opts.slurm:
        from hpar.launcher.procs.srun import SrunStep

        return SrunStep(specs, lines, rundir.path, env=opts.env).processes
    by_name = {h.name: h for h in opts.hosts}
    if getattr(opts, "ray", False):
        from hpar.launcher.procs.ray_actor import RayRun

        return RayRun(specs, lines, by_name).processes
    procs = []
    for spec in specs:
        remote = opts.ssh is not None and (not by_name[spec.host].is_local or opts.ssh.force_ssh)
        if remote:
            from hpar.launcher.procs.ssh import make_process

            procs.append(make_process(spec, by_name, opts.ssh, lines))
        else:
            procs.append(LocalProcess(spec, lines))
    return procs


def run_script(run: ScriptRun, opts, console: Console, master: str = "127.0.0.1") -> Outcome:
    """Run ``run`` to the end, restarting every rank after a failure at most
    ``opts.max_restarts`` times (TORCHELASTIC_RESTART_COUNT counts them; the script resumes
    from its own checkpoints). Writes RUN_DIR/config.json first and RUN_DIR/summary.json
    (``exit_code``, ``restarts``, ``wall_s``, the failure) in every case."""
    rundir = RunDir(run.run_dir, getattr(opts, "group_readable", False))
    atomic_write_bytes(rundir.config_path, json.dumps({"command": "launch", **asdict(run)}, indent=2).encode())
    attempt, used_ports, t0 = 0, set(), time.time()
    python = getattr(opts.ssh, "python", None)
    try:
        while True:
            lines: queue.Queue = queue.Queue()
            with Rendezvous(master, first_host_local(opts.hosts), avoid=used_ports, user_env=opts.env) as rdv:
                console.print(f"hpar: {rdv.describe()}", markup=False)
                specs = script_specs(run, opts.hosts, master, rdv.port, attempt, opts.max_restarts, python)
                for spec in specs:
                    spec.env.update({k: v for k, v in {**rdv.env, **opts.env}.items() if k not in spec.env})
                procs = _processes(specs, opts, rundir, lines)
                try:
                    with Progress(
                        [(p.spec.label, p.spec.host) for p in procs], 0, live=opts.live, console=console
                    ) as progress:
                        outcome = Supervisor(procs, lines, rundir, progress, 0.0, opts.grace).run()
                finally:
                    release(procs)  # a Ray attempt's placement group and actors
            used_ports.add(rdv.port)
            if (
                outcome.exit_code != 0
                and not rdv.hosted
                and port_taken(rundir, procs)
                and len(used_ports) <= MAX_PORT_RETRIES
            ):
                console.print(
                    f"hpar: rendezvous port {rdv.port} was taken (EADDRINUSE); starting again on another port",
                    markup=False,
                )
                continue
            if outcome.exit_code == 0 or outcome.exit_code in STOPPED_BY or attempt >= opts.max_restarts:
                break
            attempt += 1
            console.print(
                f"hpar: restart {attempt}/{opts.max_restarts}: every rank starts again "
                f"(TORCHELASTIC_RESTART_COUNT={attempt})",
                markup=False,
            )
            time.sleep(1.0)
        summary = {
            "command": "launch",
            "script": run.script,
            "args": list(run.args),
            "world_size": run.world_size,
            "exit_code": outcome.exit_code,
            "restarts": attempt,
            "wall_s": time.time() - t0,
            "run_dir": rundir.path,
        }
        if outcome.exit_code != 0:
            summary.update(failed=outcome.failed, failed_host=outcome.host, cause=outcome.cause)
        rundir.write_summary(summary)
        outcome.summary = summary
        return outcome
    finally:
        rundir.close()
