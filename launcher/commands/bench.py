"""``hpar bench SCRIPT...``: train each strategy on the same job, one after another, through
``hpar run``, and compare measured throughput, step time and bytes with the cost model.

    hpar bench examples/lm.py --gpus 2 --json out.json --plot out.png
    hpar bench examples/lm.py --gpus 4 --hosts emulate:2 --link-rate 1gbit --strategies hybrid,allreduce
    hpar bench examples/lm.py --gpus 2 --project 48 --device-tflops 15

``--link-rate`` is the link the cost model predicts for (no loopback probe then) and, with
``--hosts emulate:H``, the cap on every emulated host's link, behind the queue ``--link-queue``
names (first in first out, or fair per flow). ``--project N`` adds the cost
model's projection to N GPUs (hosts of as many GPUs as the bench's), marked PROJECTED.
"""

from __future__ import annotations

import functools
import json

import click

from hpar.launcher.bench.bench_setup import (
    check_common,
    cluster_factory,
    link_words,
    probe_emulated_link,
    with_exchange,
)
from hpar.launcher.usage import fail as _fail, table_console
from hpar.strategies.job.errors import JobError


@click.command()
@click.argument("scripts", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--gpus", type=int, default=2, show_default=True, help="Workers per run (pipeline: stages).")
@click.option(
    "--hosts", default=None, help="Host file, inline 'a:2,b:2', or emulate:H for H test hosts on this machine (root)."
)
@click.option(
    "--link-rate",
    default=None,
    help="Link bandwidth, e.g. 1gbit: the emulated hosts' cap and the cost model's link (default: probed).",
)
@click.option(
    "--link-queue",
    type=click.Choice(["fifo", "fair"]),
    default="fifo",
    show_default=True,
    help="Emulated hosts only: the queue behind --link-rate, first in first out (tbf) or fair per flow "
    "with small packets first (as a Linux host's default fq_codel).",
)
@click.option("--latency", default=None, help="Link latency for the cost model, e.g. 50us (default: probed).")
@click.option(
    "--strategies",
    default=None,
    help="Comma-separated names (default: every one): hybrid, ps, allreduce, "
    "allreduce-sparse, fsdp, pipeline-gpipe, pipeline-1f1b, pipeline-async-stash, pipeline-async-predict, pipeline-async-2bw, torch-gpipe, torch-1f1b, "
    "torch-interleaved-1f1b, torch-zbv, and with TorchRec installed torchrec, torchrec-tw, torchrec-rw, torchrec-cw.",
)
@click.option(
    "--steps", type=int, default=30, show_default=True, help="Training steps per strategy (the first 2 are warm-up)."
)
@click.option(
    "--batch-size", type=int, default=None, help="Samples per worker per step (default: the script's HPAR, else 32)."
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the model and the data, the same for every strategy.",
)
@click.option(
    "--precision",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    default=None,
    help="Every run's --precision, and the profile's (default: the script's HPAR, else fp32).",
)
@click.option(
    "--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON here."
)
@click.option(
    "--plot",
    "plot_out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a PNG of throughput and bytes here (matplotlib).",
)
@click.option("--project", type=int, default=0, help="Add the cost model's projection to N GPUs (marked projected).")
@click.option(
    "--device-tflops",
    type=float,
    default=None,
    help="Projection only: compute from FLOPs at this many TFLOP/s per GPU.",
)
@click.option(
    "--gpus-per-host", type=int, default=None, help="Projection only: GPUs per host (default: as in the bench)."
)
@click.option("--bench-dir", default=None, help="Where the runs go (default runs/bench-<timestamp>).")
@click.option(
    "--keep-models", is_flag=True, help="Keep each run's trained model and checkpoints (removed once read by default)."
)
@click.option("--ssh-key", default=None, help="SSH private key for --hosts (not needed with emulate:H).")
@click.option(
    "--timeout", "timeout_s", type=float, default=600, show_default=True, help="Seconds one strategy may run."
)
@click.option(
    "--repeat",
    type=int,
    default=1,
    show_default=True,
    help="Runs of every strategy, in rounds; the table shows the median run and the spread.",
)
@click.option(
    "--min-seconds",
    type=float,
    default=0.0,
    show_default=True,
    help="Give each strategy enough steps for this many seconds at its predicted step time (0: --steps).",
)
@click.option(
    "--worker-memory",
    type=float,
    default=None,
    metavar="GB",
    help="Every run's --worker-memory (GB); a strategy predicted not to fit is not run, with the reason.",
)
@click.option("--server-memory", type=float, default=None, metavar="GB", help="Every run's --server-memory (GB).")
@click.option(
    "--memory",
    "memory_table",
    is_flag=True,
    help="Also print each run's predicted peak memory per worker and server beside the measured one.",
)
@click.option(
    "--compress",
    default=None,
    metavar="LIST",
    help="Also run each strategy that compresses DDP's AllReduce with these --compress settings, one row "
    "each beside its uncompressed row (e.g. fp16,powersgd:2).",
)
@click.option(
    "--scale",
    default=None,
    help="Scaling curves: run on each of these numbers of emulated hosts, one "
    "worker per host (e.g. 1,2,4,8; root), beside the cost model's predictions.",
)
def bench(scripts, **given):
    """Run every strategy that applies to SCRIPT(s) and compare them (table, --json, --plot)."""
    from hpar.launcher.bench.bench_config import BenchFlags

    flags = BenchFlags(**given)
    gpus, hosts, link_rate, link_queue, latency = (
        flags.gpus,
        flags.hosts,
        flags.link_rate,
        flags.link_queue,
        flags.latency,
    )
    strategies, steps, batch_size, seed, precision = (
        flags.strategies,
        flags.steps,
        flags.batch_size,
        flags.seed,
        flags.precision,
    )
    json_out, plot_out, bench_dir, ssh_key, timeout_s = (
        flags.json_out,
        flags.plot_out,
        flags.bench_dir,
        flags.ssh_key,
        flags.timeout_s,
    )
    project, device_tflops, gpus_per_host = flags.project, flags.device_tflops, flags.gpus_per_host
    repeat, min_seconds, worker_memory, server_memory = (
        flags.repeat,
        flags.min_seconds,
        flags.worker_memory,
        flags.server_memory,
    )
    memory_table, scale = flags.memory_table, flags.scale
    if scale is not None:
        given = [
            f
            for f, v in (("--gpus", "gpus"), ("--hosts", "hosts"), ("--project", "project"))
            if click.get_current_context().get_parameter_source(v).name != "DEFAULT"
        ]
        if given:
            _fail(f"--scale sets the hosts and workers (one per emulated host); drop {', '.join(given)}")
        from hpar.launcher.bench.scale_command import bench_scale

        return bench_scale(scripts, flags)
    from hpar.launcher.bench import bench_report as report
    from hpar.launcher.bench.bench_config import BenchConfig, parse_strategies, with_compress
    from hpar.launcher.bench.driver import run_bench
    from hpar.launcher.bench.emulate import EmulatedCluster
    from hpar.launcher.hosts.emulated import parse_emulate
    from hpar.strategies.plan.cluster import parse_bandwidth

    console = table_console(140)
    try:
        if gpus < 1:
            raise ValueError(f"--gpus must be at least 1, got {gpus}")
        if project < 0 or (gpus_per_host is not None and gpus_per_host < 1):
            raise ValueError("--project and --gpus-per-host must be positive")
        bench_dir = check_common(scripts, steps, timeout_s, plot_out, bench_dir, repeat, min_seconds)
        bw = parse_bandwidth(link_rate, "--link-rate") if link_rate else None
        n_emulated = parse_emulate(hosts)
        if link_queue != "fifo" and not n_emulated:
            raise ValueError(
                f"--link-queue {link_queue} shapes emulated links: use it with --hosts emulate:H or --scale"
            )
        # after the flags checked without imports: "all" asks every runtime whether it is installed
        names = with_compress(parse_strategies(strategies), flags.compress)
        if n_emulated is None and hosts:
            from hpar.launcher.hosts.hostfile import place_workers
            from hpar.launcher.hosts.ray_nodes import cluster_hosts

            place_workers(list(cluster_hosts(hosts)), gpus)
        from hpar.strategies.plan.capacity import from_flags

        capacity = from_flags(worker_memory, server_memory)
        emulated = EmulatedCluster(n_emulated, gpus, bw, link_queue) if n_emulated else None
    except JobError as exc:
        _fail(str(exc), exc.user_traceback)
    except ValueError as exc:
        _fail(str(exc))
    try:
        if emulated:
            emulated.__enter__()
        try:
            run_hosts = emulated.host_file if emulated else hosts
            cfg = BenchConfig(
                scripts=tuple(scripts),
                gpus=gpus,
                strategies=names,
                steps=steps,
                bench_dir=bench_dir,
                batch_size=batch_size,
                seed=seed,
                hosts=run_hosts,
                ssh_key=emulated.key if emulated else ssh_key,
                bandwidth_Bps=bw,
                project=project,
                device_tflops=device_tflops,
                timeout_s=timeout_s,
                precision=precision,
                threads=emulated.threads if emulated else None,
                repeat=repeat,
                min_seconds=min_seconds,
                worker_memory_gb=worker_memory,
                server_memory_gb=server_memory,
                keep_models=flags.keep_models,
            )
            link = probe_emulated_link(emulated, console) if emulated else None
            cluster_of = cluster_factory(
                gpus_per_host, run_hosts, bw, latency, device_tflops, gpus, n_emulated, link, capacity
            )
            results = run_bench(
                cfg,
                cluster_of,
                say=lambda m: console.print(m, markup=False),
                around_run=emulated.around_run if emulated else None,
                refine=functools.partial(with_exchange, emulated, console) if emulated else None,
            )
            emulation = (
                {**emulated.describe(), "link_probe": None if link is None else link._asdict()} if emulated else None
            )
        finally:
            if emulated:
                emulated.__exit__(None, None, None)
    except JobError as exc:
        _fail(str(exc), exc.user_traceback)
    except (ValueError, RuntimeError, PermissionError) as exc:
        _fail(str(exc))
    where = f"emulated {n_emulated} hosts{link_words(link_rate, link_queue)}" if emulated else (hosts or "this machine")
    title = f"{gpus} workers, {where}, {steps} steps"
    report.print_tables(console, results, title)
    if memory_table:
        from hpar.launcher.bench.memory_report import print_memory

        print_memory(console, results, title)
    from hpar.launcher.bench.verdict import steps_warning

    if steps_warning(steps):
        console.print(steps_warning(steps), markup=False)
    if emulated:
        for r in results:
            if r.counters:
                c = r.counters
                console.print(
                    f"{r.strategy}: bytes/step hpar {c['hpar_bytes_per_step']:,.0f}, TCP sockets "
                    f"{c['tcp_bytes_per_step']:,.0f} ({c['tcp_over_hpar'] or 0:.2f}x); hpar to other hosts "
                    f"{c['hpar_remote_bytes_per_step']:,.0f}, interfaces {c['interface_bytes_per_step']:,.0f} "
                    f"(payload {c['interface_payload_bytes_per_step']:,.0f}: "
                    f"{c['interface_over_hpar_remote'] or 0:.2f}x)",
                    markup=False,
                )
    settings = {
        "gpus": gpus,
        "steps": steps,
        "min_seconds": min_seconds,
        "repeat": repeat,
        "batch_size": batch_size,
        "seed": seed,
        "hosts": hosts,
        "link_rate": link_rate,
        "link_queue": link_queue if emulated else None,
        "project": project or None,
        "device_tflops": device_tflops,
        "bench_dir": bench_dir,
        "compress": flags.compress,
    }
    if json_out:
        doc = report.document(results, report.command_line(), settings, emulation)
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
        console.print(f"hpar bench: results written to {json_out}", markup=False)
    if plot_out:
        report.plot(results, plot_out, title)
        console.print(f"hpar bench: plot written to {plot_out}", markup=False)
    console.print(
        f"hpar bench: the runs (logs, metrics, summaries{', models' if flags.keep_models else ''}) are in "
        f"{bench_dir}"
        + ("" if flags.keep_models else "; their models were removed once read (--keep-models keeps them)"),
        markup=False,
    )
