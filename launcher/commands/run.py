"""Resolve ``hpar run``'s flags, the script's HPAR defaults, a plan file or the planner, and the
host list into a RunConfig and LaunchOptions, checking everything before a process starts."""

from __future__ import annotations

import dataclasses
import os

from rich.console import Console

from hpar.launcher.hosts.environ import parse_env_flags
from hpar.launcher.hosts.hostfile import place_workers, total_slots
from hpar.launcher.hosts.ray_nodes import cluster_hosts, describe as describe_ray, is_ray
from hpar.launcher.hosts.slurm import allocation_hosts, describe as describe_allocation, in_allocation
from hpar.launcher.run.rundir import default_run_dir
from hpar.launcher.run.run_hosts import rank0_address, run_device
from hpar.strategies.plan.capacity import from_flags
from hpar.strategies.plan.fit import fit_plan
from hpar.launcher.run.flags import Flags
from hpar.launcher.run.plan_source import check_pipelined_run, plain_when_idle, plan_for
from hpar.launcher.run.validate import check_plan_stages, check_run_dir
from hpar.launcher.run.reshape import describe_reshape, old_settings, resumed_config
from hpar.strategies.plan.pipeline_grid import check_replicas_flag, plan_replicas, planner_replicas
from hpar.launcher.run.runner import LaunchOptions
from hpar.strategies.job.config import (
    FIND_UNUSED_MODES,
    RunConfig,
    check_cache_flags,
    check_loop_flags,
    find_unused,
    staleness_problem,
    sync_batchnorm_problem,
)
from hpar.strategies.specs.registry import spec as strategy_spec, where
from hpar.strategies.plan import compress_setting
from hpar.strategies.plan.strategy_settings import (
    cache_settings,
    check_optimizer,
    check_unused_by_rank,
    ddp_find_unused,
    default_micro_batches,
)
from hpar.strategies.job.forward import inner_module
from hpar.strategies.job.contract import check_job, load_job
from hpar.strategies.job.loop import check_precision
from hpar.strategies.plan.placement import placement
from hpar.strategies.plan.placement import check_fullgraph
from hpar.strategies.job.layers import is_declared_sequence
from hpar.strategies.plan.stage_cuts import sequential_layers

FALLBACKS = {
    "steps": 100,
    "batch_size": 32,
    "lr": 0.01,
    "seed": 0,
    "log_every": 10,
    "checkpoint_every": 0,
    "keep_checkpoints": 2,
    "precision": "fp32",
    "clip_grad_norm": 0.0,
    "accumulate": 1,
    "eval_every": 0,
    "find_unused_parameters": "auto",
    "allow_unequal_batches": False,
}


def resolve(console: Console, flags: Flags):
    """Everything ``hpar run`` needs, ``(RunConfig, LaunchOptions, rendezvous address)``, from
    its flags (launcher/run/flags.py), or ValueError/JobError (one line) before anything
    starts. Flags not given (None) come from the script's HPAR, else FALLBACKS. Of a resumed
    run, ``--find-unused-parameters`` and ``--allow-unequal-batches`` may change (how a run that
    failed on either goes on); ``--gpus``, ``--servers`` and the pipeline's shape make it
    resume at another size (launcher/run/reshape.py). ``--worker-memory``/``--server-memory``:
    GB each process may use; ``--force`` runs a plan predicted not to fit (strategies/plan/fit.py);
    ``--staleness``/``--cache-rows``: the workers' hot-row caches
    (strategies/plan/strategy_settings.cache_settings)."""
    j, p, h, r = flags.job, flags.plan, flags.hosts, flags.run

    def say(line: str) -> None:  # the plan stage's one-line notes, printed as given
        console.print(line, markup=False)

    script, steps, batch_size, lr, seed, log_every = j.script, j.steps, j.batch_size, j.lr, j.seed, j.log_every
    loop_flags, no_eval, find_unused_parameters = j.loop_flags, j.no_eval, j.find_unused_parameters
    strategy, plan_file, servers, schedule, device = p.strategy, p.plan_file, p.servers, p.schedule, p.device
    micro_batches, pipeline_replicas, staleness, cache_rows = (
        p.micro_batches,
        p.pipeline_replicas,
        p.staleness,
        p.cache_rows,
    )
    gpus, hosts = h.gpus, h.hosts
    run_dir, checkpoint_every, resume_dir = r.run_dir, r.checkpoint_every, r.resume_dir
    max_restarts, stall_timeout, phase_timeout = r.max_restarts, r.stall_timeout, r.phase_timeout
    loop_flags = loop_flags or {}
    check_loop_flags(**loop_flags)  # before the script is loaded and profiled
    check_cache_flags(cache_rows, staleness)
    compress = compress_setting.early(p.compress, strategy, loop_flags.get("precision"))  # before the script loads
    if j.sync_batchnorm and sync_batchnorm_problem(strategy):  # before the script loads
        raise ValueError(sync_batchnorm_problem(strategy))
    if staleness_problem(staleness, strategy):  # before the script loads
        raise ValueError(staleness_problem(staleness, strategy))
    from hpar.launcher.hosts.emulated import parse_emulate

    if hosts and parse_emulate(hosts):
        raise ValueError(
            f"--hosts {hosts}: emulated hosts are built and torn down by hpar bench and priced by hpar "
            "profile; hpar run needs real hosts: start test hosts on this machine (python "
            "scripts/testhosts.py up H, as root) and pass the host file it writes"
        )
    if gpus is not None and gpus < 1:  # also before a resume looks at the run (a finished one included)
        raise ValueError(f"--gpus must be at least 1, got {gpus}")
    capacity = from_flags(p.worker_memory, p.server_memory)
    reshaped = None
    if resume_dir:
        given = [
            flag
            for flag, value in (
                ("--gpus", gpus),
                ("--plan", plan_file),
                ("--servers", servers),
                ("--staleness", staleness),
                ("--cache-rows", cache_rows),
                ("--batch-size", batch_size),
                ("--schedule", schedule),
                ("--micro-batches", micro_batches),
                ("--pipeline-replicas", pipeline_replicas),
            )
            if value is not None
        ] + (["--strategy"] if strategy != "auto" else [])
        if (
            given
        ):  # resume at another size or plan: planned afresh from the run's own settings (launcher/run/reshape.py)
            reshaped = resumed_config(resume_dir, script, steps, say=say)
            script, run_dir, resume_dir = reshaped.script, reshaped.run_dir, None
            strategy = reshaped.strategy if strategy == "auto" and not plan_file else strategy
            servers = servers if servers is not None or strategy != reshaped.strategy else (reshaped.servers or None)
    host_list = tuple(cluster_hosts(hosts)) if hosts else ()  # a Ray cluster's nodes for --hosts ray
    if ray := is_ray(host_list):
        console.print(f"hpar: {describe_ray(list(host_list))}", markup=False)
    remote_ready = None  # (SSHOptions, rendezvous address) once the preflight passed
    extra_env = parse_env_flags(h.env)
    slurm = not host_list and in_allocation()
    if slurm:  # launcher/hosts/slurm.py: hosts and slots from the allocation, processes by srun
        host_list = tuple(allocation_hosts())
        gpus = gpus if gpus is not None else total_slots(list(host_list))
        console.print(f"hpar: {describe_allocation(list(host_list))}", markup=False)
    if max_restarts < 0 or stall_timeout < 0 or (phase_timeout or 0) < 0:
        raise ValueError("--max-restarts, --stall-timeout and --phase-timeout must not be negative")
    if resume_dir:
        cfg = resumed_config(resume_dir, script, steps, say=say)
        if r.keep_checkpoints is not None:
            cfg = cfg.replace(keep_checkpoints=r.keep_checkpoints)
        job = load_job(cfg.script)
        compress_setting.on_resume(cfg, p.compress)
        if find_unused_parameters in ("on", "off"):
            cfg = cfg.replace(find_unused_parameters=find_unused(find_unused_parameters, ()))
        if j.allow_unequal_batches:
            cfg = cfg.replace(allow_unequal_batches=True)
    else:
        if not script:
            raise ValueError("missing SCRIPT: `hpar run SCRIPT --gpus N` (or --resume RUN_DIR)")
        from hpar.launcher.run.script_kind import not_profilable

        if not_profilable(script):  # a torchrun-style script: `hpar launch` runs it
            raise ValueError(not_profilable(script))
        check_run_dir(os.path.abspath(run_dir or default_run_dir()))
        job = load_job(script)
        d = job.defaults if reshaped is None else {**job.defaults, **old_settings(reshaped)}
        gpus = gpus if gpus is not None else 1
        if gpus < 1:
            raise ValueError(f"--gpus must be at least 1, got {gpus}")
        if host_list:
            place_workers(list(host_list), gpus)
        if host_list and not slurm and not ray:  # names and SSH ports at once, in seconds, before a minute of profiling
            from hpar.launcher.hosts.reach import check_reachable
            from hpar.launcher.hosts.remote import ssh_options

            ssh_options(ssh_key=h.ssh_key, ssh_port=h.ssh_port)  # the flags first: a missing key file, a bad port
            check_reachable(place_workers(list(host_list), gpus), h.ssh_port)  # the hosts that get workers
            if h.ssh_local or any(not host.is_local for host in host_list):  # SSH login, versions, the script
                from types import SimpleNamespace
                from hpar.launcher.hosts.remote import prepare_remote

                remote_ready = prepare_remote(
                    console, host_list, SimpleNamespace(script=job.path, world_size=gpus), h, env=extra_env
                )  # the preflight, before a minute of profiling
        bs = batch_size if batch_size is not None else d.get("batch_size", FALLBACKS["batch_size"])
        if bs < 1:
            raise ValueError(f"--batch-size must be at least 1, got {bs}")
        model = check_job(job, bs)
        # a model that is not a declared sequence is cut by tracing it on a batch (strategies/job/traced.py)
        traced_on = None if is_declared_sequence(model) else next(job.batches(0, 1, bs))[0]
        strategy_flag = strategy
        strategy = check_replicas_flag(
            pipeline_replicas, gpus, strategy, model, traced_on
        )  # before the planner profiles
        spec = strategy_spec(strategy) if strategy != "auto" else None
        if (
            spec is not None and spec.pipelined and traced_on is not None
        ):  # one that does not trace is refused now, not after profiling
            sequential_layers(model, traced_on)
        pick = lambda flag, key: flag if flag is not None else d.get(key, FALLBACKS.get(key))
        staleness, cache_rows = pick(staleness, "staleness"), pick(cache_rows, "cache_rows")
        check_cache_flags(cache_rows, staleness)  # HPAR's keys too
        from hpar.strategies.specs.servers_spec import CacheConfig
        from hpar.strategies.plan.memory_model import forward_passes

        resolved = dataclasses.replace(
            p,
            strategy=strategy,
            servers=servers,
            pipeline_replicas=planner_replicas(pipeline_replicas, schedule),
            needs=("sync_batchnorm",) if pick(j.sync_batchnorm, "sync_batchnorm") else (),
            settings=tuple((k, pick(loop_flags.get(k), k)) for k in ("precision", "clip_grad_norm", "accumulate")),
        )
        strategy, plan, profile = plan_for(
            console,
            job,
            resolved,
            bs,
            hosts,
            gpus,
            (loop_flags or {}).get("precision"),
            capacity,
            CacheConfig(cache_rows or 0.0, staleness) if staleness is not None else None,
            forward_passes(pick(steps, "steps"), pick(loop_flags.get("accumulate"), "accumulate")),
        )
        spec = strategy_spec(strategy)
        replicas = plan_replicas(plan, pipeline_replicas, plan_file or "the planner's plan") if spec.pipelined else 1
        if spec.pipelined:
            check_plan_stages(plan, model, gpus // replicas, plan_file or "the planner's plan", traced_on)
        # placement() raises for a plan naming unknown parameters before anything starts; parameters are named
        # as the user wrote them, inside a torch.compile wrapper, as the profile and the workers name them
        inner = inner_module(model)
        strategy, spec = plain_when_idle(console, strategy, inner, plan, servers)
        if spec.servers:
            check_fullgraph(model, placement(inner, strategy, plan))
        used_hosts = len({h.name for h in place_workers(list(host_list), gpus)}) if host_list else 1
        if servers is None:
            servers = plan.servers or used_hosts if spec.servers else 0
        if spec.servers and servers < 1:
            raise ValueError(f"--servers must be at least 1 for --strategy {strategy}")
        if not spec.servers and servers:
            raise ValueError(
                f"--servers {servers} only applies to --strategy {' or '.join(where(servers=True))}, not {strategy}"
            )
        staleness, cache_rows, plan = cache_settings(
            say, job, inner, strategy, strategy_flag, plan, staleness, cache_rows, bs, gpus
        )
        unused_mode = pick(find_unused_parameters, "find_unused_parameters")
        if unused_mode not in FIND_UNUSED_MODES:
            raise ValueError(
                f"--find-unused-parameters {unused_mode!r} (HPAR): choose one of {', '.join(FIND_UNUSED_MODES)}"
            )
        if find_unused_parameters not in (None, "auto") and strategy_flag != "auto" and not spec.ddp:
            raise ValueError(
                f"--find-unused-parameters {find_unused_parameters}: --strategy {strategy} runs no DDP "
                f"(only {', '.join(where(ddp=True))} do); drop it"
            )
        check_optimizer(say, job, inner, strategy, plan, pick(lr, "lr"))
        check_unused_by_rank(job, strategy, plan, inner, bs, gpus)  # FSDP2 and a mixture of experts
        if spec.check_available:
            spec.load("check_available")()  # a library the strategy needs (FSDP2: torch.distributed.fsdp)
        if spec.check_model:  # the model and optimizer the runtime can run (torchrec: tables, fused optimizer)
            note = spec.load("check_model")(job, inner, pick(lr, "lr"))
            if note:
                console.print(note, markup=False)
        # auto with --compress: the compression the planner chose (strategies/plan/compress_setting.py)
        compress = compress_setting.from_plan(say, compress, plan)
        cfg = RunConfig(
            script=job.path,
            strategy=strategy,
            world_size=gpus,
            steps=pick(steps, "steps"),
            batch_size=bs,
            lr=pick(lr, "lr"),
            seed=pick(seed, "seed"),
            run_dir=os.path.abspath(run_dir or default_run_dir()),
            device="cpu" if device == "auto" else device,
            log_every=pick(log_every, "log_every"),
            servers=servers,
            schedule=schedule or plan.schedule or "1f1b",
            micro_batches=micro_batches
            or d.get("micro_batches")
            or default_micro_batches(say, plan, bs, gpus // replicas, model),
            checkpoint_every=pick(checkpoint_every, "checkpoint_every"),
            plan=plan,
            eval=not no_eval,
            keep_checkpoints=pick(r.keep_checkpoints, "keep_checkpoints"),
            **{
                key: pick(loop_flags.get(key), key)
                for key in ("precision", "clip_grad_norm", "accumulate", "eval_every")
            },
            on_divergence=r.on_divergence,
            divergence_factor=r.divergence_factor,
            replicas=replicas,
            find_unused_parameters=ddp_find_unused(say, job, unused_mode, strategy, plan, inner, bs, gpus),
            allow_unequal_batches=bool(pick(j.allow_unequal_batches, "allow_unequal_batches")),
            sync_batchnorm=bool(pick(j.sync_batchnorm, "sync_batchnorm")),
            staleness=staleness,
            cache_rows=cache_rows,
            compress=compress_setting.decide(say, compress, strategy, strategy_flag, device),
        )
        check_precision(job, cfg, model)
        if spec.pipelined:
            check_pipelined_run(console, job, cfg, model, traced_on, bs, gpus)
        if reshaped is not None:
            cfg = cfg.replace(resume=True)
            console.print(f"hpar: {describe_reshape(reshaped, cfg)}", markup=False)
        elif os.path.exists(os.path.join(cfg.run_dir, "config.json")):
            raise ValueError(f"--run-dir {cfg.run_dir} already holds a run; pick a new directory or use --resume")
    if resume_dir:
        check_run_dir(cfg.run_dir, "--resume")
    ssh_opts, master = rank0_address(console, cfg, host_list, h, slurm, ray, extra_env, remote_ready)
    if not resume_dir:  # a resumed run keeps its device
        cfg, hosts_used = run_device(console, cfg, host_list, ssh_opts, slurm, ray, device)
        chosen = cfg.device
        from hpar.launcher.run.plan_run import compute_mismatch

        if compute_mismatch(cfg.plan, chosen):  # CPU figures for GPU workers are never taken silently
            console.print(f"hpar: {compute_mismatch(cfg.plan, chosen)}", markup=False)
        local = not host_list or all(h.is_local for h in host_list)
        cfg = fit_plan(
            say, cfg, job, model, capacity, [h.name for h in hosts_used], local, p.force, profile
        )  # predicted peaks vs memory
    opts = LaunchOptions(
        hosts=host_list,
        ssh=ssh_opts,
        stall_timeout=stall_timeout,
        phase_timeout=phase_timeout,
        max_restarts=max_restarts,
        group_readable=r.group_readable,
        live=False if r.plain else None,
        sync=h.sync,
        env=extra_env,
        slurm=slurm,
        ray=ray,
        unused_restart=(find_unused_parameters or job.defaults.get("find_unused_parameters")) != "off",
    )
    return cfg, opts, master
