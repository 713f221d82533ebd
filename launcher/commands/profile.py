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

import dataclasses
import json

import click
from rich.console import Console
from rich.table import Table

from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.strategies.specs.base import ON_ALLREDUCE
from hpar.launcher.run.cluster_build import DEFAULT_LATENCY, build_cluster

CLUSTER_FLAGS = ("gpus", "hosts", "servers", "bandwidth", "latency", "device_tflops", "device_mem_gbps")
from hpar.launcher.usage import fail as _fail, table_console
from hpar.strategies.job.errors import JobError

def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g} {prefix}{unit}"
        n /= 1000
    return f"{n:.3g} P{unit}"


def report(profile, cluster, plan) -> dict:
    """The ``--json`` object: parameters, layers, candidates, plan, cluster, profile totals."""
    params = [{"name": p.name, "shape": list(p.shape), "bytes": p.bytes, "sparse": p.sparse,
               "alpha": p.alpha, "union_alpha": p.union_alpha, "embedding_module": p.embedding_module,
               "layer": p.layer, "placement": plan.placement.get(p.name, ON_ALLREDUCE), "dedup_s": p.dedup_s,
               "tied_to": list(p.tied_to), "lookups": p.lookups, "bags": p.bags}
              for p in profile.params]
    layers = [{"name": l.name, "forward_s": l.forward_s, "backward_s": l.backward_s, "flops": l.flops,
               "activation_bytes": l.activation_bytes, "param_bytes": l.param_bytes} for l in profile.layers]
    cands = [{"strategy": c.strategy, "predicted_step_s": c.predicted_step_s, "samples_per_s": c.samples_per_s,
              "bytes_per_step": c.bytes_per_step, "available": c.available, "note": c.note,
              "breakdown": c.breakdown, "memory": c.memory} for c in plan.candidates]
    plan_d = plan.to_dict()
    plan_d.pop("candidates")
    return {"parameters": params, "layers": layers, "candidates": cands, "plan": plan_d,
            "cluster": {"hosts": cluster.hosts, "gpus_per_host": list(cluster.gpus_per_host), "workers": cluster.workers,
                        "servers": cluster.servers, "bandwidth_Bps": cluster.bandwidth_Bps,
                        "latency_s": cluster.latency_s, "device_flops": cluster.device_flops,
                        "device_mem_Bps": cluster.device_mem_Bps, "source": cluster.source,
                        "cores_per_host": cluster.cores_per_host, "allreduce_Bps": cluster.allreduce_Bps,
                        "allgather_Bps": cluster.allgather_Bps, "request_cpu_s": cluster.request_cpu_s,
                        "worker_memory_bytes": cluster.worker_memory_bytes,
                        "server_memory_bytes": cluster.server_memory_bytes,
                        "allreduce_fixed_s": cluster.allreduce_fixed_s, "allgather_fixed_s": cluster.allgather_fixed_s,
                        "reduce_scatter_fixed_s": cluster.reduce_scatter_fixed_s, "sparse_round_s": cluster.sparse_round_s},
            "profile": {"device": profile.device, "batch_size": profile.batch_size, "data_s": profile.data_s,
                        "samples_per_batch": profile.samples_per_batch,
                        "compute_s": profile.compute_s, "forward_flops": profile.forward_flops,
                        "backward_flops": profile.backward_flops, "is_sequential": profile.is_sequential,
                        "sequential_reason": profile.sequential_reason, "traced": profile.traced,
                        "shared_params": [[n, list(held)] for n, held in profile.shared_params],
                        "timing_batch_size": profile.timing_batch_size,
                        "profile_s": profile.profile_s, "update_s_per_byte": profile.update_s_per_byte,
                        "sparse_update_s_per_byte": profile.sparse_update_s_per_byte,
                        "host_update_s_per_byte": profile.host_update_s_per_byte,
                        "update_s_per_tensor": profile.update_s_per_tensor, "fsdp_overhead_s": profile.fsdp_overhead_s,
                        "step_overhead_s": profile.step_overhead_s,
                        "compress_s": [list(x) for x in profile.compress_s] if profile.compress_s is not None else None,
                        "unused_params": list(profile.unused_params), "unused_by_rank": profile.unused_by_rank,
                        "memory": dataclasses.asdict(profile.memory) if profile.memory else None}}


def print_tables(console: Console, profile, cluster, plan) -> None:
    """Rich tables: parameters (sparse first), layers, candidates, then the plan and why."""
    t = Table(title=f"Parameters ({_human(profile.total_bytes)})")
    for col in ("name", "shape", "bytes", "sparse", "alpha", f"union ({cluster.workers})", "placement"):
        t.add_column(col, justify="left" if col in ("name", "placement") else "right")
    for p in profile.params:
        t.add_row(p.name, "x".join(map(str, p.shape)), _human(p.bytes),
                  "yes" if p.sparse else (f"no: tied to {', '.join(p.tied_to)}" if p.tied_to else ""),
                  f"{p.alpha:.4f}" if p.sparse else "", f"{p.union_alpha:.4f}" if p.sparse else "",
                  plan.placement.get(p.name, ON_ALLREDUCE))
    console.print(t)
    t = Table(title=f"Layers ({'a pipeline can cut between them' if profile.is_sequential else profile.sequential_reason}; "
                    f"batch {profile.batch_size}, {'1 CPU thread' if profile.device == 'cpu' else profile.device})")
    for col in ("#", "layer", "forward", "backward", "FLOPs", "activations", "params"):
        t.add_column(col, justify="left" if col == "layer" else "right")
    # Between two modules that are not a sequence runs the forward's own glue (a matmul of two
    # layers' outputs, the loss): its backward falls between their gradient hooks, on no module
    # of its own, so per-layer backward times are shown only where the layers compose the model.
    attributed = profile.is_sequential
    for i, l in enumerate(profile.layers):
        t.add_row(str(i), l.name, f"{l.forward_s * 1e3:.2f} ms", f"{l.backward_s * 1e3:.2f} ms" if attributed else "-",
                  _human(l.flops, ""), _human(l.activation_bytes), _human(l.param_bytes))
    console.print(t)
    if not attributed:
        console.print(f"  backward: {profile.backward_s * 1e3:.2f} ms in all; per layer only for a sequence of layers "
                      "(the forward's glue between these modules has no layer to be charged to)", markup=False)
    if profile.unused_params:   # strategies/profile/unused.py: DDP's find_unused_parameters, FSDP2
        shown = ", ".join(profile.unused_params[:3]) + (", ..." if len(profile.unused_params) > 3 else "")
        console.print(f"  unused parameters: {len(profile.unused_params)} got no gradient in a profiled step ({shown})"
                      + ("; which differs between the ranks' batches of one step (routing)" if profile.unused_by_rank
                         else ""), markup=False)
    link = (f"{_human(cluster.bandwidth_Bps)}/s, {cluster.latency_s * 1e6:.0f} us ({cluster.source})")
    if cluster.allreduce_fixed_s is not None:   # strategies/plan/probe_collectives.py
        link += f", a small AllReduce {cluster.allreduce_fixed_s * 1e3:.2f} ms"
    dev = f", compute {plan.compute}"
    t = Table(title=f"Candidates: {cluster.workers} workers on {cluster.hosts} host(s), {cluster.servers} server(s), "
                    f"link {link}{dev}; memory {_capacity(cluster)}")
    numbers = ("step", "samples/s", "sent/worker/step", "peak/worker", "peak/server")
    for col in ("strategy",) + numbers + ("runs", "note"):
        t.add_column(col, justify="right" if col in numbers else "left")
    for c in plan.candidates:
        ok = c.predicted_step_s > 0
        mem = c.memory or {}
        peak = lambda key: _human(mem[key]) if mem.get(key) is not None else "-"
        t.add_row(c.strategy, f"{c.predicted_step_s * 1e3:.2f} ms" if ok else "-",
                  f"{c.samples_per_s:,.0f}" if ok else "-", _human(c.bytes_per_step) if ok else "-",
                  peak("worker_peak_bytes"), peak("server_peak_bytes"), "yes" if c.available else "no", c.note)
    console.print(t)
    extra = ""
    if strategy_spec(plan.strategy).pipelined:
        extra = f" stages {plan.stages}, {plan.micro_batches} micro-batches, {plan.schedule}."
    elif plan.partitions:
        extra = " partitions " + ", ".join(f"{k}: {v}" for k, v in plan.partitions.items()) + "."
    console.print(f"[bold]Plan:[/bold] {plan.reason}{extra}", soft_wrap=True)   # the reason starts with the name


def _capacity(cluster) -> str:
    """The memory each process may use, for the candidates' title: "2.1 GB per worker, ..."
    (peaks in the table are above a process's fixed overhead, which the fit test adds)."""
    parts = [f"{_human(b)} per {who}" for b, who in ((cluster.worker_memory_bytes, "worker"),
                                                     (cluster.server_memory_bytes, "server")) if b]
    return ", ".join(parts) + " (peaks above a process's fixed overhead)" if parts else "not checked (no capacity known)"


@click.command()
@click.argument("script", type=click.Path(dir_okay=False))
@click.option("--gpus", type=int, default=None, help="Workers to plan for (default: every slot of --hosts or of the Slurm allocation, else 1).")
@click.option("--hosts", default=None, help="Host file, inline 'a:2,b:2', HxG (H hosts of G GPUs) for a projection, "
                                          "emulate:H (hpar bench's emulated hosts), or ray / ray://HEAD:10001 (a Ray cluster's nodes).")
@click.option("--servers", type=int, default=None, help="Parameter servers (default one per host).")
@click.option("--bandwidth", default=None, help="Link bandwidth, e.g. 10Gbps, 25GB/s (default: measured on this machine).")
@click.option("--latency", default=None, help=f"Per-message latency, e.g. 50us, 1ms (default: measured, else {DEFAULT_LATENCY}).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Measure on this device: the workers' (auto: cuda when this machine sees a GPU).")
@click.option("--device-tflops", type=float, default=None, help="Compute from FLOPs at this many TFLOP/s per worker (projection to GPUs).")
@click.option("--device-mem-gbps", type=float, default=None,
              help="With --device-tflops: the device's memory bandwidth in GB/s; each layer then costs "
                   "max(FLOPs / TFLOP/s, bytes moved / bandwidth) (roofline).")
@click.option("--batch-size", type=int, default=None, help="Samples per worker per step (default: the script's HPAR, else 32).")
@click.option("--timing-batch-size", type=int, default=None, help="Time compute on smaller batches and scale linearly (large models).")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="Time the forward passes under the workers' precision (default: the script's HPAR, else fp32).")
@click.option("--worker-memory", type=float, default=None, metavar="GB",
              help="Memory of each worker's device in GB (10^9 bytes); default: the GPU's, or this host's RAM over its processes.")
@click.option("--server-memory", type=float, default=None, metavar="GB",
              help="Host memory of each parameter server in GB; default: this host's RAM over its processes.")
@click.option("--staleness", type=int, default=None,
              help="Let the plan use hybrid with hot-row caches on the workers, reading rows up to S updates stale "
                   "(hybrid-cache; without it that row is shown at S = 4 and never chosen).")
@click.option("--cache-rows", type=float, default=None,
              help="With --staleness: rows cached per table (>= 1) or a fraction of each table (< 1; default 0.1).")
@click.option("--compress", default=None, metavar="off|fp16|bf16|powersgd[:RANK]",
              help="Let the plan compress DDP's AllReduce this way (an accuracy trade: without it the compressed "
                   "rows are shown and never chosen).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--plan-out", type=click.Path(dir_okay=False), default=None, help="Write the plan as JSON for `hpar run --plan`.")
def profile(script, as_json, plan_out, **given):
    """Measure SCRIPT, predict every strategy on the cluster, and choose a plan."""
    from hpar.strategies.job.errors import check_script_file
    try:
        check_script_file(script)   # there, readable, compiles: before torch is imported
    except ValueError as exc:
        _fail(str(exc))
    from hpar.strategies.state.checkpoint import atomic_write_bytes
    from hpar.strategies.job.config import check_cache_flags
    from hpar.strategies.specs.servers_spec import CacheConfig
    cluster_flags = {k: given.pop(k) for k in CLUSTER_FLAGS}   # --gpus, --hosts, ...: launcher/run/cluster_build.py
    device, batch_size, timing_batch_size, precision = (given[k] for k in ("device", "batch_size", "timing_batch_size",
                                                                             "precision"))
    worker_memory, server_memory, staleness, cache_rows = (given[k] for k in ("worker_memory", "server_memory",
                                                                               "staleness", "cache_rows"))
    from hpar.strategies.job.compression import Compression
    try:
        compress = Compression.parse(given["compress"]) if given["compress"] is not None else None
    except ValueError as exc:   # before the script is loaded
        _fail(str(exc))
    from hpar.strategies.job.contract import check_job, load_job
    from hpar.strategies.plan.memory_model import forward_passes
    from hpar.strategies.plan.vet import vetted_plan   # nothing runnable that `hpar run` would refuse
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
            check_cache_flags(cache_rows, staleness)
            if timing_batch_size is not None and timing_batch_size < 1:
                raise ValueError(f"--timing-batch-size must be at least 1, got {timing_batch_size}")
            from hpar.strategies.plan.capacity import from_flags
            capacity = from_flags(worker_memory, server_memory)
            measure_on = profile_device(device)
            cluster = build_cluster(**cluster_flags, measured_on=measure_on.type, capacity=capacity)
            check_job(job, bs)   # the user's own errors, named as theirs, before any measuring
            prof = profile_job(job, bs, cluster.workers, timing_batch_size=timing_batch_size, device=measure_on,
                               precision=precision, compress=compress)
            steps = job.defaults.get("steps")   # the run's length as the script sets it: its workers' growth
            plan = vetted_plan(job, prof, cluster,
                               cache=CacheConfig(cache_rows or 0.0, staleness) if staleness is not None else None,
                               forwards=forward_passes(steps, job.defaults.get("accumulate")), compress=compress)
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
