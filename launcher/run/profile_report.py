"""What ``hpar profile`` prints: the profile, the cluster and every strategy's prediction with
the chosen plan, as rich tables or as the one JSON object of ``--json``."""

from __future__ import annotations

import dataclasses

from rich.console import Console
from rich.table import Table

from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.strategies.specs.base import ON_ALLREDUCE


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g} {prefix}{unit}"
        n /= 1000
    return f"{n:.3g} P{unit}"


def report(profile, cluster, plan) -> dict:
    """The ``--json`` object: parameters, layers, candidates, plan, cluster, profile totals."""
    params = [
        {
            "name": p.name,
            "shape": list(p.shape),
            "bytes": p.bytes,
            "sparse": p.sparse,
            "alpha": p.alpha,
            "union_alpha": p.union_alpha,
            "embedding_module": p.embedding_module,
            "layer": p.layer,
            "placement": plan.placement.get(p.name, ON_ALLREDUCE),
            "dedup_s": p.dedup_s,
            "tied_to": list(p.tied_to),
            "lookups": p.lookups,
            "bags": p.bags,
        }
        for p in profile.params
    ]
    layers = [
        {
            "name": l.name,
            "forward_s": l.forward_s,
            "backward_s": l.backward_s,
            "flops": l.flops,
            "activation_bytes": l.activation_bytes,
            "param_bytes": l.param_bytes,
        }
        for l in profile.layers
    ]
    cands = [
        {
            "strategy": c.strategy,
            "predicted_step_s": c.predicted_step_s,
            "samples_per_s": c.samples_per_s,
            "bytes_per_step": c.bytes_per_step,
            "available": c.available,
            "note": c.note,
            "breakdown": c.breakdown,
            "memory": c.memory,
        }
        for c in plan.candidates
    ]
    plan_d = plan.to_dict()
    plan_d.pop("candidates")
    return {
        "parameters": params,
        "layers": layers,
        "candidates": cands,
        "plan": plan_d,
        "cluster": {
            "hosts": cluster.hosts,
            "gpus_per_host": list(cluster.gpus_per_host),
            "workers": cluster.workers,
            "servers": cluster.servers,
            "bandwidth_Bps": cluster.bandwidth_Bps,
            "latency_s": cluster.latency_s,
            "device_flops": cluster.device_flops,
            "device_mem_Bps": cluster.device_mem_Bps,
            "source": cluster.source,
            "cores_per_host": cluster.cores_per_host,
            "allreduce_Bps": cluster.allreduce_Bps,
            "allgather_Bps": cluster.allgather_Bps,
            "request_cpu_s": cluster.request_cpu_s,
            "worker_memory_bytes": cluster.worker_memory_bytes,
            "server_memory_bytes": cluster.server_memory_bytes,
            "allreduce_fixed_s": cluster.allreduce_fixed_s,
            "allgather_fixed_s": cluster.allgather_fixed_s,
            "reduce_scatter_fixed_s": cluster.reduce_scatter_fixed_s,
            "sparse_round_s": cluster.sparse_round_s,
        },
        "profile": {
            "device": profile.device,
            "batch_size": profile.batch_size,
            "data_s": profile.data_s,
            "samples_per_batch": profile.samples_per_batch,
            "compute_s": profile.compute_s,
            "forward_flops": profile.forward_flops,
            "backward_flops": profile.backward_flops,
            "is_sequential": profile.is_sequential,
            "sequential_reason": profile.sequential_reason,
            "traced": profile.traced,
            "shared_params": [[n, list(held)] for n, held in profile.shared_params],
            "timing_batch_size": profile.timing_batch_size,
            "profile_s": profile.profile_s,
            "update_s_per_byte": profile.update_s_per_byte,
            "sparse_update_s_per_byte": profile.sparse_update_s_per_byte,
            "host_update_s_per_byte": profile.host_update_s_per_byte,
            "update_s_per_tensor": profile.update_s_per_tensor,
            "fsdp_overhead_s": profile.fsdp_overhead_s,
            "step_overhead_s": profile.step_overhead_s,
            "compress_s": [list(x) for x in profile.compress_s] if profile.compress_s is not None else None,
            "unused_params": list(profile.unused_params),
            "unused_by_rank": profile.unused_by_rank,
            "memory": dataclasses.asdict(profile.memory) if profile.memory else None,
        },
    }


def print_tables(console: Console, profile, cluster, plan) -> None:
    """Rich tables: parameters (sparse first), layers, candidates, then the plan and why."""
    t = Table(title=f"Parameters ({_human(profile.total_bytes)})")
    for col in ("name", "shape", "bytes", "sparse", "alpha", f"union ({cluster.workers})", "placement"):
        t.add_column(col, justify="left" if col in ("name", "placement") else "right")
    for p in profile.params:
        t.add_row(
            p.name,
            "x".join(map(str, p.shape)),
            _human(p.bytes),
            "yes" if p.sparse else (f"no: tied to {', '.join(p.tied_to)}" if p.tied_to else ""),
            f"{p.alpha:.4f}" if p.sparse else "",
            f"{p.union_alpha:.4f}" if p.sparse else "",
            plan.placement.get(p.name, ON_ALLREDUCE),
        )
    console.print(t)
    t = Table(
        title=f"Layers ({'a pipeline can cut between them' if profile.is_sequential else profile.sequential_reason}; "
        f"batch {profile.batch_size}, {'1 CPU thread' if profile.device == 'cpu' else profile.device})"
    )
    for col in ("#", "layer", "forward", "backward", "FLOPs", "activations", "params"):
        t.add_column(col, justify="left" if col == "layer" else "right")
    # Between two modules that are not a sequence runs the forward's own glue (a matmul of two
    # layers' outputs, the loss): its backward falls between their gradient hooks, on no module
    # of its own, so per-layer backward times are shown only where the layers compose the model.
    attributed = profile.is_sequential
    for i, l in enumerate(profile.layers):
        t.add_row(
            str(i),
            l.name,
            f"{l.forward_s * 1e3:.2f} ms",
            f"{l.backward_s * 1e3:.2f} ms" if attributed else "-",
            _human(l.flops, ""),
            _human(l.activation_bytes),
            _human(l.param_bytes),
        )
    console.print(t)
    if not attributed:
        console.print(
            f"  backward: {profile.backward_s * 1e3:.2f} ms in all; per layer only for a sequence of layers "
            "(the forward's glue between these modules has no layer to be charged to)",
            markup=False,
        )
    if profile.unused_params:  # strategies/profile/unused.py: DDP's find_unused_parameters, FSDP2
        shown = ", ".join(profile.unused_params[:3]) + (", ..." if len(profile.unused_params) > 3 else "")
        console.print(
            f"  unused parameters: {len(profile.unused_params)} got no gradient in a profiled step ({shown})"
            + ("; which differs between the ranks' batches of one step (routing)" if profile.unused_by_rank else ""),
            markup=False,
        )
    link = f"{_human(cluster.bandwidth_Bps)}/s, {cluster.latency_s * 1e6:.0f} us ({cluster.source})"
    if cluster.allreduce_fixed_s is not None:  # strategies/plan/probe_collectives.py
        link += f", a small AllReduce {cluster.allreduce_fixed_s * 1e3:.2f} ms"
    dev = f", compute {plan.compute}"
    t = Table(
        title=f"Candidates: {cluster.workers} workers on {cluster.hosts} host(s), {cluster.servers} server(s), "
        f"link {link}{dev}; memory {_capacity(cluster)}"
    )
    numbers = ("step", "samples/s", "sent/worker/step", "peak/worker", "peak/server")
    for col in ("strategy",) + numbers + ("runs", "note"):
        t.add_column(col, justify="right" if col in numbers else "left")
    for c in plan.candidates:
        ok = c.predicted_step_s > 0
        mem = c.memory or {}
        peak = lambda key: _human(mem[key]) if mem.get(key) is not None else "-"
        t.add_row(
            c.strategy,
            f"{c.predicted_step_s * 1e3:.2f} ms" if ok else "-",
            f"{c.samples_per_s:,.0f}" if ok else "-",
            _human(c.bytes_per_step) if ok else "-",
            peak("worker_peak_bytes"),
            peak("server_peak_bytes"),
            "yes" if c.available else "no",
            c.note,
        )
    console.print(t)
    extra = ""
    if strategy_spec(plan.strategy).pipelined:
        extra = f" stages {plan.stages}, {plan.micro_batches} micro-batches, {plan.schedule}."
    elif plan.partitions:
        extra = " partitions " + ", ".join(f"{k}: {v}" for k, v in plan.partitions.items()) + "."
    console.print(f"[bold]Plan:[/bold] {plan.reason}{extra}", soft_wrap=True)  # the reason starts with the name


def _capacity(cluster) -> str:
    """The memory each process may use, for the candidates' title: "2.1 GB per worker, ..."
    (peaks in the table are above a process's fixed overhead, which the fit test adds)."""
    parts = [
        f"{_human(b)} per {who}"
        for b, who in ((cluster.worker_memory_bytes, "worker"), (cluster.server_memory_bytes, "server"))
        if b
    ]
    return (
        ", ".join(parts) + " (peaks above a process's fixed overhead)" if parts else "not checked (no capacity known)"
    )
