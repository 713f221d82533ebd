"""``hpar profile SCRIPT``: measure the job, describe the cluster, predict every strategy and
print the chosen plan (rich tables, or one JSON object with ``--json``).

The cluster may be one the user does not have (a projection): ``--hosts 8x6 --gpus 48
--bandwidth 100Gbps --device-tflops 15``. Without ``--bandwidth``, when every host is this
machine, the link is measured by a loopback probe between two gloo endpoints
(``strategies/plan/probe.py``); for remote hosts without ``--bandwidth`` hpar assumes
10 Gbps and says so (it does not log in to hosts to profile). ``--hosts emulate:H`` is the
cluster ``hpar bench --hosts emulate:H`` runs on: H hosts that share this machine's cores and
talk within a host over its loopback, their link capped at ``--bandwidth``.
"""

from __future__ import annotations

import json

import click

from hpar.launcher.run.cluster_build import DEFAULT_LATENCY, build_cluster
from hpar.launcher.run.profile_report import print_tables, report

CLUSTER_FLAGS = ("gpus", "hosts", "servers", "bandwidth", "latency", "device_tflops", "device_mem_gbps")
from hpar.launcher.usage import fail as _fail, table_console
from hpar.strategies.job.errors import JobError


@click.command()
@click.argument("script", type=click.Path(dir_okay=False))
@click.option(
    "--gpus",
    type=int,
    default=None,
    help="Workers to plan for (default: every slot of --hosts or of the Slurm allocation, else 1).",
)
@click.option(
    "--hosts",
    default=None,
    help="Host file, inline 'a:2,b:2', HxG (H hosts of G GPUs) for a projection, "
    "emulate:H (hpar bench's emulated hosts), or ray / ray://HEAD:10001 (a Ray cluster's nodes).",
)
@click.option("--servers", type=int, default=None, help="Parameter servers (default one per host).")
@click.option(
    "--bandwidth", default=None, help="Link bandwidth, e.g. 10Gbps, 25GB/s (default: measured on this machine)."
)
@click.option(
    "--latency", default=None, help=f"Per-message latency, e.g. 50us, 1ms (default: measured, else {DEFAULT_LATENCY})."
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Measure on this device: the workers' (auto: cuda when this machine sees a GPU).",
)
@click.option(
    "--device-tflops",
    type=float,
    default=None,
    help="Compute from FLOPs at this many TFLOP/s per worker (projection to GPUs).",
)
@click.option(
    "--device-mem-gbps",
    type=float,
    default=None,
    help="With --device-tflops: the device's memory bandwidth in GB/s; each layer then costs "
    "max(FLOPs / TFLOP/s, bytes moved / bandwidth) (roofline).",
)
@click.option(
    "--batch-size", type=int, default=None, help="Samples per worker per step (default: the script's HPAR, else 32)."
)
@click.option(
    "--timing-batch-size",
    type=int,
    default=None,
    help="Time compute on smaller batches and scale linearly (large models).",
)
@click.option(
    "--precision",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    default=None,
    help="Time the forward passes under the workers' precision (default: the script's HPAR, else fp32).",
)
@click.option(
    "--worker-memory",
    type=float,
    default=None,
    metavar="GB",
    help="Memory of each worker's device in GB (10^9 bytes); default: the GPU's, or this host's RAM over its processes.",
)
@click.option(
    "--server-memory",
    type=float,
    default=None,
    metavar="GB",
    help="Host memory of each parameter server in GB; default: this host's RAM over its processes.",
)
@click.option(
    "--staleness",
    type=int,
    default=None,
    help="Let the plan use hybrid with hot-row caches on the workers, reading rows up to S updates stale "
    "(hybrid-cache; without it that row is shown at S = 4 and never chosen).",
)
@click.option(
    "--cache-rows",
    type=float,
    default=None,
    help="With --staleness: rows cached per table (>= 1) or a fraction of each table (< 1; default 0.1).",
)
@click.option(
    "--compress",
    default=None,
    metavar="off|fp16|bf16|powersgd[:RANK]",
    help="Let the plan compress DDP's AllReduce this way (an accuracy trade: without it the compressed "
    "rows are shown and never chosen).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option(
    "--plan-out", type=click.Path(dir_okay=False), default=None, help="Write the plan as JSON for `hpar run --plan`."
)
def profile(script, as_json, plan_out, **given):
    """Measure SCRIPT, predict every strategy on the cluster, and choose a plan."""
    from hpar.strategies.job.errors import check_script_file

    try:
        check_script_file(script)  # there, readable, compiles: before torch is imported
    except ValueError as exc:
        _fail(str(exc))
    from hpar.strategies.state.checkpoint import atomic_write_bytes
    from hpar.strategies.job.config import check_cache_flags
    from hpar.strategies.plan.cluster import check_link_flags
    from hpar.strategies.specs.servers_spec import CacheConfig

    cluster_flags = {k: given.pop(k) for k in CLUSTER_FLAGS}  # --gpus, --hosts, ...: launcher/run/cluster_build.py
    device, batch_size, timing_batch_size, precision = (
        given[k] for k in ("device", "batch_size", "timing_batch_size", "precision")
    )
    worker_memory, server_memory, staleness, cache_rows = (
        given[k] for k in ("worker_memory", "server_memory", "staleness", "cache_rows")
    )
    from hpar.strategies.job.compression import Compression

    try:  # the flags, before the script is loaded (and torch imported)
        compress = Compression.parse(given["compress"]) if given["compress"] is not None else None
        check_link_flags(cluster_flags["bandwidth"], cluster_flags["latency"])
        check_cache_flags(cache_rows, staleness)
        if timing_batch_size is not None and timing_batch_size < 1:
            raise ValueError(f"--timing-batch-size must be at least 1, got {timing_batch_size}")
    except ValueError as exc:
        _fail(str(exc))
    from hpar.strategies.job.contract import check_job, load_job
    from hpar.strategies.plan.memory_model import forward_passes
    from hpar.strategies.plan.vet import vetted_plan  # nothing runnable that `hpar run` would refuse
    from hpar.strategies.profile.device import profile_device
    from hpar.strategies.profile.profiler import profile_job
    from hpar.launcher.run.leftovers import ended_at_exit

    # what the script's data() or model() left running in a session of its own is ended (on stderr: --json)
    with ended_at_exit(lambda line: click.echo(line, err=True)):
        try:
            from hpar.launcher.run.script_kind import not_profilable

            if not_profilable(script):  # a torchrun-style script: `hpar launch` runs it
                raise ValueError(not_profilable(script))
            job = load_job(script)
            bs = batch_size if batch_size is not None else int(job.defaults.get("batch_size", 32))
            if bs < 1:
                raise ValueError(f"--batch-size must be at least 1, got {bs}")
            from hpar.strategies.plan.capacity import from_flags

            capacity = from_flags(worker_memory, server_memory)
            measure_on = profile_device(device)
            cluster = build_cluster(**cluster_flags, measured_on=measure_on.type, capacity=capacity)
            check_job(job, bs)  # the user's own errors, named as theirs, before any measuring
            prof = profile_job(
                job,
                bs,
                cluster.workers,
                timing_batch_size=timing_batch_size,
                device=measure_on,
                precision=precision,
                compress=compress,
            )
            steps = job.defaults.get("steps")  # the run's length as the script sets it: its workers' growth
            plan = vetted_plan(
                job,
                prof,
                cluster,
                cache=CacheConfig(cache_rows or 0.0, staleness) if staleness is not None else None,
                forwards=forward_passes(steps, job.defaults.get("accumulate")),
                compress=compress,
            )
        except JobError as exc:
            _fail(str(exc), exc.user_traceback)
        except (ValueError, RuntimeError) as exc:
            _fail(str(exc))
        except KeyboardInterrupt:
            from hpar.launcher.usage import interrupted

            interrupted("profiling")
    if plan_out:
        atomic_write_bytes(plan_out, (plan.to_json() + "\n").encode())
    if as_json:
        click.echo(json.dumps(report(prof, cluster, plan)))
    else:
        console = table_console(120)
        print_tables(console, prof, cluster, plan)
        console.print(f"profiled in {prof.profile_s:.1f} s" + (f"; plan written to {plan_out}" if plan_out else ""))
