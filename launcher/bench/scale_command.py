"""``hpar bench --scale``: one bench per number of emulated hosts (one worker per host), beside
the cost model's predictions, printed as scaling curves (and written as JSON and a PNG)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

from hpar.launcher.bench.bench_setup import (
    check_common,
    cluster_factory,
    link_words,
    probe_emulated_link,
    with_exchange,
)
from hpar.launcher.usage import fail as _fail, table_console
from hpar.strategies.job.errors import JobError


def bench_scale(scripts, flags) -> None:
    """``hpar bench --scale``: one bench per host count on emulated hosts (launcher/bench/scale.py);
    ``flags``: launcher/bench/bench_config.BenchFlags."""
    scale, link_rate, latency, link_queue, strategies = (
        flags.scale,
        flags.link_rate,
        flags.latency,
        flags.link_queue,
        flags.strategies,
    )
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
        bench_dir = check_common(scripts, steps, timeout_s, plot_out, bench_dir, repeat, min_seconds)
        bw = parse_bandwidth(link_rate, "--link-rate") if link_rate else None
        pts, links, emulations = [], {}, {}
        for n in counts:
            with EmulatedCluster(n, n, bw, link_queue) as em:
                cfg = BenchConfig(
                    scripts=tuple(scripts),
                    gpus=n,
                    strategies=names,
                    steps=steps,
                    bench_dir=os.path.join(bench_dir, f"hosts-{n}"),
                    batch_size=batch_size,
                    seed=seed,
                    hosts=em.host_file,
                    ssh_key=em.key,
                    bandwidth_Bps=bw,
                    timeout_s=timeout_s,
                    precision=precision,
                    threads=em.threads,
                    repeat=repeat,
                    min_seconds=min_seconds,
                    keep_models=flags.keep_models,
                )
                link = probe_emulated_link(em, console)
                links[n] = None if link is None else link._asdict()
                emulations[n] = em.describe()
                cluster_of = cluster_factory(None, em.host_file, bw, latency, None, n, n, link)
                results = run_bench(
                    cfg,
                    cluster_of,
                    say=lambda m: console.print(m, markup=False),
                    around_run=em.around_run,
                    refine=functools.partial(with_exchange, em, console),
                )
            pts += points(n, results)
    except JobError as exc:
        _fail(str(exc), exc.user_traceback)
    except (ValueError, RuntimeError, PermissionError) as exc:
        _fail(str(exc))
    print_scale(console, pts)
    title = f"one worker per emulated host{link_words(link_rate, link_queue)}, {steps} steps"
    if json_out:
        doc = {
            "command": report.command_line(),
            "machine": report.machine(),
            "settings": {
                "scale": list(counts),
                "link_rate": link_rate,
                "link_queue": link_queue,
                "latency": latency,
                "steps": steps,
                "precision": precision,
                "repeat": repeat,
                "min_seconds": min_seconds,
                "batch_size": batch_size,
                "seed": seed,
                "bench_dir": bench_dir,
                "link_probe": {str(n): v for n, v in links.items()},
                "emulation": {str(n): v for n, v in emulations.items()},
            },
            "points": [dataclasses.asdict(p) for p in pts],
            "rankings": rankings(pts),
        }
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
        console.print(f"hpar bench: results written to {json_out}", markup=False)
    if plot_out:
        plot_scale(pts, plot_out, title)
        console.print(f"hpar bench: plot written to {plot_out}", markup=False)
