"""``hpar run`` from resolved options to a finished run: place workers and
servers on hosts, write the run directory, start and supervise every process, write the
summary, and restart from the last checkpoint when ``--max-restarts`` allows."""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field, replace

from rich.console import Console

from hpar.launcher.hosts.hostfile import Host, place_workers
from hpar.launcher.procs.local import LocalProcess, run_specs
from hpar.launcher.run.batchcheck import BatchSizeCheck
from hpar.launcher.run.elastic import shrink
from hpar.launcher.run.first_figures import FirstFigures
from hpar.launcher.run.health import heartbeat_interval
from hpar.strategies.plan.peaks import PeakFigures
from hpar.launcher.run.progress import STOPPED_BY, Progress, last_reported
from hpar.launcher.run.rendezvous import MAX_PORT_RETRIES, Rendezvous, first_host_local, port_taken
from hpar.launcher.run.rundir import RunDir
from hpar.launcher.run.supervisor import Outcome, Supervisor
from hpar.launcher.run.validate import resume_step
from hpar.strategies.state import checkpoint
from hpar.strategies.job.config import RunConfig


@dataclass(frozen=True)
class LaunchOptions:
    """How to start processes (not what to train): hosts, SSH, monitoring, restarts."""

    hosts: tuple[Host, ...] = ()
    ssh: object | None = None  # launcher.ssh.SSHOptions when SSH is used
    stall_timeout: float = 0.0
    phase_timeout: float | None = (
        None  # evaluate(), first batch, checkpoint and model writes, server requests (None: stall_timeout)
    )
    max_restarts: int = 0
    grace: float = 5.0
    live: bool | None = None
    sync: bool = False
    env: dict = field(default_factory=dict)  # --env values: every process gets them (launcher/hosts/environ.py)
    slurm: bool = False  # inside a Slurm allocation: one srun step (launcher/procs/srun.py)
    min_hosts: int = 0  # --min-hosts: restarts go on with the hosts that answer (launcher/run/elastic.py)
    group_readable: bool = False  # --group-readable: a new run directory is made 0750, not 0700
    unused_restart: bool = True  # a DDP step left a parameter unused: restart with find_unused_parameters on
    ray: bool = False  # --hosts ray: processes start as Ray actors (launcher/procs/ray_actor.py)


def placement(cfg: RunConfig, hosts: tuple[Host, ...]) -> tuple[list[Host], list[Host]]:
    """Hosts of each worker rank and each server index. Servers go round-robin over the hosts
    that have workers (one per host by default, as in Parallax)."""
    hosts = hosts or (Host("localhost", cfg.world_size),)
    workers = place_workers(list(hosts), cfg.world_size)
    used = list(dict.fromkeys(workers))
    return workers, [used[i % len(used)] for i in range(cfg.servers)]


def thread_env(spec, host: Host, procs_on_host: int, opts: LaunchOptions) -> None:
    """CPU threads of a process (workers/worker.py's ``cpu_threads``): the user's
    ``OMP_NUM_THREADS``, from ``--env`` or else from the launcher's environment (which every
    process inherits or is forwarded, launcher/hosts/environ.py), when it is a positive count
    (e.g. hosts that share one machine's cores); else on this machine its cores over the hpar
    processes on it; on another host (over SSH or Slurm) that host's own cores over
    ``HPAR_PROCS_ON_HOST``, counted there, since its core count can differ."""
    user = opts.env.get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS", "")
    if user.isdigit() and int(user) > 0:
        spec.env.setdefault("HPAR_THREADS", user)
    elif host.is_local and not opts.slurm:
        spec.env.setdefault("HPAR_THREADS", str(max(1, (os.cpu_count() or 1) // procs_on_host)))
    else:
        spec.env.setdefault("HPAR_PROCS_ON_HOST", str(procs_on_host))


def _processes(cfg: RunConfig, rundir: RunDir, opts: LaunchOptions, lines: queue.Queue, master: str, port: int):
    worker_hosts, server_hosts = placement(cfg, opts.hosts)
    python = getattr(opts.ssh, "python", None)
    specs = run_specs(
        cfg.world_size,
        cfg.servers,
        rundir.config_path,
        master,
        port,
        [h.name for h in worker_hosts],
        [h.name for h in server_hosts],
        python=python,
        config_sha256=rundir.config_sha256,
    )
    by_name = {h.name: h for h in worker_hosts + server_hosts}
    per_host = {}
    for s in specs:
        per_host[s.host] = per_host.get(s.host, 0) + 1
    procs = []
    for spec in specs:
        thread_env(spec, by_name[spec.host], per_host[spec.host], opts)
        spec.env.setdefault("HPAR_HEARTBEAT_S", str(heartbeat_interval(opts.stall_timeout, opts.phase_timeout)))
        for key, value in opts.env.items():  # hpar's own variables win
            spec.env.setdefault(key, value)
    if opts.slurm:
        from hpar.launcher.procs.srun import SrunStep

        return SrunStep(specs, lines, rundir.path, python=python, env=opts.env).processes
    if opts.ray:
        from hpar.launcher.procs.ray_actor import RayRun

        return RayRun(specs, lines, by_name).processes
    for spec in specs:
        remote = opts.ssh is not None and (not by_name[spec.host].is_local or getattr(opts.ssh, "force_ssh", False))
        if remote:
            from hpar.launcher.procs.ssh import make_process

            procs.append(make_process(spec, by_name, opts.ssh, lines))
        else:
            procs.append(LocalProcess(spec, lines))
    return procs


def _elastic(
    cfg: RunConfig, opts: LaunchOptions, master: str, console: Console, attempt: int, elastic: list[dict], lost: set
) -> tuple[RunConfig, LaunchOptions, str, bool]:
    """Before restart ``attempt`` with ``--min-hosts``: check the hosts again and go on with
    those that answer (launcher/run/elastic.py; on a Ray cluster: its alive nodes less those
    ``lost`` in the attempt); returns the restart's config, options and rendezvous address, and
    whether to restart at all."""
    from hpar.launcher.hosts.preflight import preflight, resolve_master

    if opts.ray:
        from hpar.launcher.hosts.ray_nodes import gone

        answering = {
            name: why or ("lost during the run" if name in lost else "") for name, why in gone(opts.hosts).items()
        }
    else:
        report = preflight(list(opts.hosts), cfg.script, opts.ssh, 0)
        answering = {row.host: row.problem for row in report.rows}
    if not any(answering.values()):
        return cfg, opts, master, True
    plan = shrink(cfg, opts.hosts, answering, opts.min_hosts)
    console.print(f"hpar: {plan.describe()}", markup=False)
    elastic.append(plan.record(attempt))
    if plan.cfg is None:
        return cfg, opts, master, False
    return plan.cfg, replace(opts, hosts=plan.kept), resolve_master(list(plan.kept)), True


def _unused_restart(cfg: RunConfig, outcome, console: Console) -> RunConfig:
    """The run again with DDP's ``find_unused_parameters`` on, from its last checkpoint (or the
    start), after a step left a parameter without a gradient that no profiled step had
    (``outcome.cause``, strategies/runtimes/dataparallel/ddp.py); said in one line."""
    try:
        step = resume_step(cfg.run_dir, lambda m: console.print(m, markup=False))
    except ValueError:
        step = None
    which = outcome.cause.split(" (", 1)[1].split(")", 1)[0] if " (" in outcome.cause else "a parameter"
    console.print(
        f"hpar: a step left {which} without a gradient, unlike the profiled steps; restarting from "
        f"{'step ' + str(step) if step is not None else 'the start'} with --find-unused-parameters on",
        markup=False,
    )
    return cfg.replace(find_unused_parameters=True, resume=step is not None)


def release(procs) -> None:
    """Remove what an engine holds for an attempt's processes: the placement group and actors of
    a Ray run (launcher/procs/ray_actor.py); nothing for the other hosts."""
    for run in {id(p.run): p.run for p in procs if hasattr(getattr(p, "run", None), "release")}.values():
        run.release()


def launch(cfg: RunConfig, opts: LaunchOptions, console: Console, master: str = "127.0.0.1") -> Outcome:
    """Run ``cfg`` to the end (with up to ``opts.max_restarts`` restarts from the last
    checkpoint). Writes RUN_DIR/summary.json with ``exit_code`` in every case."""
    rundir = RunDir(cfg.run_dir, opts.group_readable, adopt=cfg.resume)
    previous = rundir.read_summary()
    figures = FirstFigures(rundir.path, cfg.world_size, cfg.strategy)
    peaks = PeakFigures(rundir)  # measured peak memory per process (strategies/plan/peaks.py)
    attempt = 0
    used_ports: set[int] = set()
    elastic: list[dict] = []  # the restarts that left hosts out (--min-hosts)
    try:
        while True:
            checkpoint.remove_temp_files(rundir.path)  # left by a process killed mid-write
            for path in checkpoint.remove_incomplete_steps(rundir.path):
                console.print(
                    f"hpar: removed {path}: a write that did not complete (it is not resumed from)", markup=False
                )
            rundir.write_config(cfg)
            lines: queue.Queue = queue.Queue()
            with Rendezvous(
                master, first_host_local(opts.hosts), avoid=used_ports, user_env=opts.env
            ) as rdv:  # launcher/run/rendezvous.py
                console.print(f"hpar: {rdv.describe()}", markup=False)
                procs = _processes(cfg, rundir, replace(opts, env={**rdv.env, **opts.env}), lines, master, rdv.port)
                labels = [(p.spec.label, p.spec.host) for p in procs]
                try:
                    with Progress(labels, cfg.steps, live=opts.live, console=console) as progress:
                        sizes = BatchSizeCheck(cfg.world_size, cfg.strategy, progress.say)
                        hooks = lambda proc, event: (
                            figures.on_event(proc, event),
                            sizes.on_event(proc, event),
                            peaks.on_event(proc, event),
                        )
                        sup = Supervisor(
                            procs,
                            lines,
                            rundir,
                            progress,
                            opts.stall_timeout,
                            opts.grace,
                            total_steps=cfg.steps,
                            on_event=hooks,
                            phase_timeout=opts.phase_timeout,
                        )
                        outcome = sup.run()
                finally:
                    release(procs)  # a Ray attempt's placement group and actors, on every path
            checkpoint.remove_temp_files(rundir.path)
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
            if outcome.unused and not cfg.find_unused_parameters and opts.unused_restart:
                cfg = _unused_restart(cfg, outcome, console)
                continue
            if outcome.unused:
                console.print(f"hpar: {outcome.cause}", markup=False)
            interrupted = outcome.exit_code in STOPPED_BY
            refused = (
                outcome.exit_code == 2
            )  # the script's input (strategies/job/first_batch.py): a restart cannot help
            if outcome.exit_code == 0 or interrupted or refused or attempt >= opts.max_restarts:
                break
            attempt += 1
            if opts.min_hosts and (opts.ssh is not None or opts.ray) and opts.hosts:
                lost = {p.spec.host for p in procs if p.host_lost}
                cfg, opts, master, go_on = _elastic(cfg, opts, master, console, attempt, elastic, lost)
                if not go_on:
                    break
            try:
                step = resume_step(cfg.run_dir, lambda m: console.print(m, markup=False))
            except ValueError as exc:
                console.print(f"hpar: {exc}", markup=False)
                step = None
            console.print(
                f"hpar: restart {attempt}/{opts.max_restarts} from "
                f"{'step ' + str(step) if step is not None else 'the start (no checkpoint yet)'}",
                markup=False,
            )
            cfg = cfg.replace(resume=step is not None)
            time.sleep(1.0)
        # stopped early: "steps" is the step it reached (the last one reported), not the one asked for
        summary = (
            peaks.apply(figures.apply(outcome.summary, previous, resumed=cfg.resume), cfg.plan)
            if outcome.summary
            else {
                "strategy": cfg.strategy,
                "world_size": cfg.world_size,
                "steps_planned": cfg.steps,
                **last_reported(progress),
            }
        )
        outcome.summary = summary if outcome.summary else None
        summary.update(
            exit_code=outcome.exit_code,
            restarts=attempt,
            run_dir=rundir.path,
            **({"elastic": elastic} if elastic else {}),
            **({"tuning": cfg.plan.tuning} if cfg.plan.tuning else {}),
            **({"predicted_step_s": cfg.plan.predicted_step_s} if cfg.plan.predicted_step_s else {}),
        )
        if outcome.exit_code != 0:
            summary.update(failed=outcome.failed, failed_host=outcome.host, cause=outcome.cause)
        try:
            rundir.write_summary(summary)
        except OSError as exc:
            console.print(f"hpar: {rundir.path}: cannot write summary.json ({exc.strerror})", markup=False)
        if rundir.write_error:
            console.print(f"hpar: {rundir.write_error}", markup=False)
        return outcome
    finally:
        rundir.close()
