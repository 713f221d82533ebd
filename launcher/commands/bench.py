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

import dataclasses
import datetime
import functools
import json
import os

import click

from hpar.launcher.usage import fail as _fail, table_console
from hpar.strategies.job.errors import JobError


def _check_common(scripts, steps: int, timeout_s: float, plot_out, bench_dir, repeat: int = 1,
                  min_seconds: float = 0.0) -> str:
    """The checks every ``hpar bench`` makes before it runs anything (ValueError naming the
    flag or the script); returns the absolute bench directory (default runs/bench-<UTC time>)."""
    if steps < 4:
        raise ValueError(f"--steps must be at least 4 (2 warm-up steps, then measured ones), got {steps}")
    if timeout_s <= 0:
        raise ValueError(f"--timeout must be positive, got {timeout_s}")
    if repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {repeat}")
    if min_seconds < 0:
        raise ValueError(f"--min-seconds must be 0 or more, got {min_seconds}")
    for s in scripts:
        if not os.path.isfile(s):
            raise ValueError(f"{s}: no such script; pass the path of a training script")
    if plot_out:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install 'hpar[plot]' (or matplotlib)")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return os.path.abspath(bench_dir or os.path.join("runs", f"bench-{stamp}"))


def _probe(em, console):
    """The emulated link's LinkFigures as measured, announced on the console (None on one host)."""
    link = em.probe_link()
    if link is not None:
        cap = f" (cap {em.bandwidth_Bps / 1e6:.2f} MB/s)" if em.bandwidth_Bps else ""
        console.print(f"hpar bench: emulated link measured at {link[0] / 1e6:.2f} MB/s{cap}, "
                      f"latency {link[1] * 1e6:.0f} us"
                      + (f", a sparse gradient's exchange over {em.n_hosts} hosts {link.sparse_round_s * 1e3:.1f} ms"
                         if link.sparse_round_s is not None else ""), markup=False)
    return link


def _with_exchange(em, console, profile, cluster):
    """``cluster`` with the job's allreduce-sparse gradient exchange (sparse tables and dense
    buckets in flight together) as measured over the emulated hosts at its own sizes
    (``EmulatedCluster.probe_exchange``), announced on the console; unchanged without an
    embedding table, on one host, or with more workers than hosts (the probe runs one process
    per host)."""
    if cluster.workers != em.n_hosts:
        return cluster
    seconds = em.probe_exchange(profile)
    if seconds is None:
        return cluster
    console.print(f"hpar bench: this script's gradient exchange (sparse tables and dense buckets) over "
                  f"{em.n_hosts} hosts, measured at its own sizes: {seconds * 1e3:.1f} ms", markup=False)
    return dataclasses.replace(cluster, gradient_exchange_s=seconds)


def _cluster_factory(gpus_per_host: int | None, hosts: str | None, bandwidth_Bps: float | None,
                     latency: str | None, device_tflops: float | None, bench_gpus: int,
                     emulated_hosts: int | None = None, link=None, capacity=None):
    """gpus -> ClusterSpec for the cost model: the bench's hosts for the bench's GPU count;
    for a projection, hosts of ``gpus_per_host`` (or of the bench's busiest host) GPUs each.
    The link is ``bandwidth_Bps`` or one loopback probe (``profile_cli.build_cluster``).
    ``emulated_hosts`` H: the hosts are this machine's namespaces (``hpar profile --hosts
    emulate:H`` describes the same cluster: shared cores, loopback within a host). ``link``: the
    emulated link's (bandwidth, latency, ...) as measured (``EmulatedCluster.probe_link``), which the cost model then uses
    instead of the cap (its latency unless ``latency`` is given); ``capacity``: the memory of a
    worker and a server (strategies/plan/capacity.py), this machine's where not given."""
    from hpar.launcher.run.cluster_build import build_cluster
    from hpar.strategies.plan.cluster import make_cluster
    bw = f"{bandwidth_Bps}B/s" if bandwidth_Bps else None
    base = build_cluster(bench_gpus, f"emulate:{emulated_hosts}" if emulated_hosts else hosts, None, bw, latency, None,
                         capacity=capacity)
    if link is not None:
        base = dataclasses.replace(base, bandwidth_Bps=link[0], latency_s=base.latency_s if latency else link[1],
                                   allgather_Bps=link.allgather_Bps, sparse_round_s=link.sparse_round_s,
                                   source="probe between emulated hosts")

    def cluster_of(gpus: int):
        flops = device_tflops * 1e12 if device_tflops and gpus != bench_gpus else None
        if gpus == bench_gpus and not flops:
            return base
        g = gpus_per_host or base.max_gpus_per_host
        return make_cluster([g] * -(-gpus // g), gpus, None, base.bandwidth_Bps, base.latency_s, device_flops=flops,
                            source=base.source, allreduce_Bps=None if flops else base.allreduce_Bps,
                            allgather_Bps=base.allgather_Bps)
    return cluster_of


def _link_words(link_rate: str | None, link_queue: str) -> str:
    """`` at 25mbit`` (`` at 25mbit, fair queues``) for the titles; empty without a cap."""
    if not link_rate:
        return ""
    return f" at {link_rate}" + (", fair queues" if link_queue == "fair" else "")


@click.command()
@click.argument("scripts", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--gpus", type=int, default=2, show_default=True, help="Workers per run (pipeline: stages).")
@click.option("--hosts", default=None, help="Host file, inline 'a:2,b:2', or emulate:H for H test hosts on this machine (root).")
@click.option("--link-rate", default=None, help="Link bandwidth, e.g. 1gbit: the emulated hosts' cap and the cost model's link (default: probed).")
@click.option("--link-queue", type=click.Choice(["fifo", "fair"]), default="fifo", show_default=True,
              help="Emulated hosts only: the queue behind --link-rate, first in first out (tbf) or fair per flow "
              "with small packets first (as a Linux host's default fq_codel).")
@click.option("--latency", default=None, help="Link latency for the cost model, e.g. 50us (default: probed).")
@click.option("--strategies", default=None, help="Comma-separated names (default: every one): hybrid, ps, allreduce, "
              "allreduce-sparse, fsdp, pipeline-gpipe, pipeline-1f1b, pipeline-async-stash, pipeline-async-predict, pipeline-async-2bw, torch-gpipe, torch-1f1b, "
              "torch-interleaved-1f1b, torch-zbv, and with TorchRec installed torchrec, torchrec-tw, torchrec-rw, torchrec-cw.")
@click.option("--steps", type=int, default=30, show_default=True, help="Training steps per strategy (the first 2 are warm-up).")
@click.option("--batch-size", type=int, default=None, help="Samples per worker per step (default: the script's HPAR, else 32).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the model and the data, the same for every strategy.")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="Every run's --precision, and the profile's (default: the script's HPAR, else fp32).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON here.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None, help="Write a PNG of throughput and bytes here (matplotlib).")
@click.option("--project", type=int, default=0, help="Add the cost model's projection to N GPUs (marked projected).")
@click.option("--device-tflops", type=float, default=None, help="Projection only: compute from FLOPs at this many TFLOP/s per GPU.")
@click.option("--gpus-per-host", type=int, default=None, help="Projection only: GPUs per host (default: as in the bench).")
@click.option("--bench-dir", default=None, help="Where the runs go (default runs/bench-<timestamp>).")
@click.option("--keep-models", is_flag=True, help="Keep each run's trained model and checkpoints (removed once read by default).")
@click.option("--ssh-key", default=None, help="SSH private key for --hosts (not needed with emulate:H).")
@click.option("--timeout", "timeout_s", type=float, default=600, show_default=True, help="Seconds one strategy may run.")
@click.option("--repeat", type=int, default=1, show_default=True,
              help="Runs of every strategy, in rounds; the table shows the median run and the spread.")
@click.option("--min-seconds", type=float, default=0.0, show_default=True,
              help="Give each strategy enough steps for this many seconds at its predicted step time (0: --steps).")
@click.option("--worker-memory", type=float, default=None, metavar="GB",
              help="Every run's --worker-memory (GB); a strategy predicted not to fit is not run, with the reason.")
@click.option("--server-memory", type=float, default=None, metavar="GB", help="Every run's --server-memory (GB).")
@click.option("--memory", "memory_table", is_flag=True,
              help="Also print each run's predicted peak memory per worker and server beside the measured one.")
@click.option("--compress", default=None, metavar="LIST",
              help="Also run each strategy that compresses DDP's AllReduce with these --compress settings, one row "
              "each beside its uncompressed row (e.g. fp16,powersgd:2).")
@click.option("--scale", default=None, help="Scaling curves: run on each of these numbers of emulated hosts, one "
              "worker per host (e.g. 1,2,4,8; root), beside the cost model's predictions.")
def bench(scripts, **given):
    """Run every strategy that applies to SCRIPT(s) and compare them (table, --json, --plot)."""
    from hpar.launcher.bench.bench_config import BenchFlags
    flags = BenchFlags(**given)
    gpus, hosts, link_rate, link_queue, latency = flags.gpus, flags.hosts, flags.link_rate, flags.link_queue, flags.latency
    strategies, steps, batch_size, seed, precision = flags.strategies, flags.steps, flags.batch_size, flags.seed, flags.precision
    json_out, plot_out, bench_dir, ssh_key, timeout_s = flags.json_out, flags.plot_out, flags.bench_dir, flags.ssh_key, flags.timeout_s
    project, device_tflops, gpus_per_host = flags.project, flags.device_tflops, flags.gpus_per_host
    repeat, min_seconds, worker_memory, server_memory = flags.repeat, flags.min_seconds, flags.worker_memory, flags.server_memory
    memory_table, scale = flags.memory_table, flags.scale
    if scale is not None:
        given = [f for f, v in (("--gpus", "gpus"), ("--hosts", "hosts"), ("--project", "project"))
                 if click.get_current_context().get_parameter_source(v).name != "DEFAULT"]
        if given:
            _fail(f"--scale sets the hosts and workers (one per emulated host); drop {', '.join(given)}")
        return _bench_scale(scripts, flags)
    from hpar.launcher.bench import bench_report as report
    from hpar.launcher.bench.bench_config import BenchConfig, parse_strategies, with_compress
    from hpar.launcher.bench.driver import run_bench
    from hpar.launcher.bench.emulate import EmulatedCluster
    from hpar.launcher.hosts.emulated import parse_emulate
    from hpar.strategies.plan.cluster import parse_bandwidth
    console = table_console(140)
    try:
        names = with_compress(parse_strategies(strategies), flags.compress)
        if gpus < 1:
            raise ValueError(f"--gpus must be at least 1, got {gpus}")
        if project < 0 or (gpus_per_host is not None and gpus_per_host < 1):
            raise ValueError("--project and --gpus-per-host must be positive")
        bench_dir = _check_common(scripts, steps, timeout_s, plot_out, bench_dir, repeat, min_seconds)
        bw = parse_bandwidth(link_rate, "--link-rate") if link_rate else None
        n_emulated = parse_emulate(hosts)
        if link_queue != "fifo" and not n_emulated:
            raise ValueError(f"--link-queue {link_queue} shapes emulated links: use it with --hosts emulate:H or --scale")
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
            cfg = BenchConfig(scripts=tuple(scripts), gpus=gpus, strategies=names, steps=steps, bench_dir=bench_dir,
                              batch_size=batch_size, seed=seed, hosts=run_hosts,
                              ssh_key=emulated.key if emulated else ssh_key, bandwidth_Bps=bw, project=project,
                              device_tflops=device_tflops, timeout_s=timeout_s, precision=precision,
                              threads=emulated.threads if emulated else None, repeat=repeat,
                              min_seconds=min_seconds, worker_memory_gb=worker_memory, server_memory_gb=server_memory,
                              keep_models=flags.keep_models)
            link = _probe(emulated, console) if emulated else None
            cluster_of = _cluster_factory(gpus_per_host, run_hosts, bw, latency, device_tflops, gpus, n_emulated, link,
                                          capacity)
            results = run_bench(cfg, cluster_of, say=lambda m: console.print(m, markup=False),
                                around_run=emulated.around_run if emulated else None,
                                refine=functools.partial(_with_exchange, emulated, console) if emulated else None)
            emulation = {**emulated.describe(), "link_probe": None if link is None else link._asdict()} if emulated else None
        finally:
            if emulated:
                emulated.__exit__(None, None, None)
    except JobError as exc:
        _fail(str(exc), exc.user_traceback)
    except (ValueError, RuntimeError, PermissionError) as exc:
        _fail(str(exc))
    where = f"emulated {n_emulated} hosts{_link_words(link_rate, link_queue)}" if emulated else (hosts or "this machine")
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
                console.print(f"{r.strategy}: bytes/step hpar {c['hpar_bytes_per_step']:,.0f}, TCP sockets "
                              f"{c['tcp_bytes_per_step']:,.0f} ({c['tcp_over_hpar'] or 0:.2f}x); hpar to other hosts "
                              f"{c['hpar_remote_bytes_per_step']:,.0f}, interfaces {c['interface_bytes_per_step']:,.0f} "
                              f"(payload {c['interface_payload_bytes_per_step']:,.0f}: "
                              f"{c['interface_over_hpar_remote'] or 0:.2f}x)", markup=False)
    settings = {"gpus": gpus, "steps": steps, "min_seconds": min_seconds, "repeat": repeat, "batch_size": batch_size,
                "seed": seed, "hosts": hosts, "link_rate": link_rate, "link_queue": link_queue if emulated else None,
                "project": project or None, "device_tflops": device_tflops, "bench_dir": bench_dir,
                "compress": flags.compress}
    if json_out:
        doc = report.document(results, report.command_line(), settings, emulation)
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
        console.print(f"hpar bench: results written to {json_out}", markup=False)
    if plot_out:
        report.plot(results, plot_out, title)
        console.print(f"hpar bench: plot written to {plot_out}", markup=False)
    console.print(f"hpar bench: the runs (logs, metrics, summaries{', models' if flags.keep_models else ''}) are in "
                  f"{bench_dir}" + ("" if flags.keep_models else "; their models were removed once read "
                                    "(--keep-models keeps them)"), markup=False)


def _bench_scale(scripts, flags) -> None:
    """``hpar bench --scale``: one bench per host count on emulated hosts (launcher/bench/scale.py);
    ``flags``: launcher/bench/bench_config.BenchFlags."""
    scale, link_rate, latency, link_queue, strategies = flags.scale, flags.link_rate, flags.latency, flags.link_queue, flags.strategies
    steps, batch_size, seed, precision = flags.steps, flags.batch_size, flags.seed, flags.precision
    json_out, plot_out, bench_dir, timeout_s = flags.json_out, flags.plot_out, flags.bench_dir, flags.timeout_s
    repeat, min_seconds = flags.repeat, flags.min_seconds
    from hpar.launcher.bench import bench_report as report
    from hpar.launcher.bench.bench_config import BenchConfig, parse_strategies, with_compress
    from hpar.launcher.bench.driver import run_bench
    from hpar.launcher.bench.emulate import EmulatedCluster
    from hpar.launcher.bench.scale import parse_scale, plot_scale, points, print_scale, rankings
    from hpar.strategies.plan.cluster import parse_bandwidth
    console = table_console(140)
    try:
        counts = parse_scale(scale)
        names = with_compress(parse_strategies(strategies), flags.compress)
        bench_dir = _check_common(scripts, steps, timeout_s, plot_out, bench_dir, repeat, min_seconds)
        bw = parse_bandwidth(link_rate, "--link-rate") if link_rate else None
        pts, links, emulations = [], {}, {}
        for n in counts:
            with EmulatedCluster(n, n, bw, link_queue) as em:
                cfg = BenchConfig(scripts=tuple(scripts), gpus=n, strategies=names, steps=steps,
                                  bench_dir=os.path.join(bench_dir, f"hosts-{n}"), batch_size=batch_size, seed=seed,
                                  hosts=em.host_file, ssh_key=em.key, bandwidth_Bps=bw, timeout_s=timeout_s,
                                  precision=precision, threads=em.threads, repeat=repeat, min_seconds=min_seconds,
                                  keep_models=flags.keep_models)
                link = _probe(em, console)
                links[n] = None if link is None else link._asdict()
                emulations[n] = em.describe()
                cluster_of = _cluster_factory(None, em.host_file, bw, latency, None, n, n, link)
                results = run_bench(cfg, cluster_of, say=lambda m: console.print(m, markup=False),
                                    around_run=em.around_run, refine=functools.partial(_with_exchange, em, console))
            pts += points(n, results)
    except JobError as exc:
        _fail(str(exc), exc.user_traceback)
    except (ValueError, RuntimeError, PermissionError) as exc:
        _fail(str(exc))
    print_scale(console, pts)
    title = f"one worker per emulated host{_link_words(link_rate, link_queue)}, {steps} steps"
    if json_out:
        doc = {"command": report.command_line(), "machine": report.machine(),
               "settings": {"scale": list(counts), "link_rate": link_rate, "link_queue": link_queue, "latency": latency,
                            "steps": steps, "precision": precision, "repeat": repeat, "min_seconds": min_seconds,
                            "batch_size": batch_size, "seed": seed, "bench_dir": bench_dir,
                            "link_probe": {str(n): v for n, v in links.items()},
                            "emulation": {str(n): v for n, v in emulations.items()}},
               "points": [dataclasses.asdict(p) for p in pts], "rankings": rankings(pts)}
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
        console.print(f"hpar bench: results written to {json_out}", markup=False)
    if plot_out:
        plot_scale(pts, plot_out, title)
        console.print(f"hpar bench: plot written to {plot_out}", markup=False)
