"""Predicted peak memory of one worker and one parameter server of every candidate plan, beside
its step time: what ``hpar profile`` prints, the planner's fit test, and what ``hpar run``
records as ``predicted_peak_bytes`` next to the measured ``peak_bytes`` (strategies/common/measured_memory.py).

A peak is predicted *above the process's baseline* (after imports and process-group set-up),
as the runs measure it; what must fit a device adds the measured fixed overhead
(``overhead_bytes``; :func:`misfit`). Each term is **counted** (from parameter shapes, the plan
and the runtime's code) or **measured** (by the profile, strategies/profile/memory_profile.py);
the terms, one by one: docs/strategies.md, "The terms of a predicted peak". Notation: P
parameter bytes (P_k a pipeline stage's, P_s a server's shard), r the optimizer's state bytes
per parameter byte, N workers, S servers, K stages, M micro-batches. After the last step:
strategies/plan/memory_sharded.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.costmodel import INDEX_BYTES, Estimate
from hpar.strategies.profile.records import MemoryProfile, Profile
from hpar.strategies.profile.shapes import distinct_after
from hpar.strategies.specs.base import ON_SERVERS
from hpar.strategies.specs.registry import spec as strategy_spec

GB = 1e9  # --worker-memory and --server-memory count 10^9 bytes
# Forward passes a worker is assumed to run where the caller gives no run length, and the steps
# whose growth a profile from before the shape census counts (its growth per step, this often).
GROWTH_HORIZON_STEPS = 32
# The processes' own runtime beyond the model (gloo's point-to-point pairs, threads, the inbox's
# bookkeeping), measured as the peak of tests/conftest.py's TINY and EMBED_TINY models (a few
# hundred parameters) above what the terms below predict for them, 2 workers, 6 steps, here:
RUNTIME_BYTES = {"hybrid_worker": 5_000_000, "stage": 3_000_000, "server": 4_000_000, "fsdp": 3_000_000}
LASTING = ("first_use", "growth", "data", "runtime")  # worker terms still held after the last step


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peaks (bytes above a process's baseline) of the busiest worker and server, by
    term (the module docstring); ``overhead_bytes``: a process's measured fixed resident
    overhead (CPU), ``device_overhead_bytes``: a GPU's memory outside torch's allocator."""

    worker: dict[str, int]
    server: dict[str, int] = field(default_factory=dict)
    overhead_bytes: int = 0
    device_overhead_bytes: int = 0
    device: str = "cpu"
    final: dict[str, int] = field(default_factory=dict)  # worker 0 after the last step (memory_sharded.py)

    @property
    def worker_peak_bytes(self) -> int:
        return int(sum(self.worker.values()))

    @property
    def worker_final_bytes(self) -> int | None:
        """Worker 0's peak after the last step, building evaluate()'s whole copy (None: none)."""
        return int(sum(self.final.values())) if self.final else None

    @property
    def server_peak_bytes(self) -> int | None:
        return int(sum(self.server.values())) if self.server else None

    def misfit(self, cluster: ClusterSpec) -> str:
        """Why this does not fit ``cluster``'s memory (:func:`misfit`)."""
        return misfit(self.to_dict(None), cluster.worker_memory_bytes, cluster.server_memory_bytes)

    def to_dict(self, cluster: ClusterSpec | None) -> dict:
        """The ``memory`` object of ``hpar profile --json`` and of a plan (``fits`` against
        ``cluster``'s memory, None without a cluster)."""
        return {
            "worker_peak_bytes": self.worker_peak_bytes,
            "server_peak_bytes": self.server_peak_bytes,
            "overhead_bytes": self.device_overhead_bytes if self.device == "cuda" else self.overhead_bytes,
            "server_overhead_bytes": self.overhead_bytes,
            "fits": None if cluster is None else not self.misfit(cluster),
            "worker_terms": dict(self.worker),
            "server_terms": dict(self.server),
            "worker_final_bytes": self.worker_final_bytes,
            "final_terms": dict(self.final),
        }


def misfit(memory: dict, worker_bytes: float | None, server_bytes: float | None) -> str:
    """Why predicted peaks (a ``memory`` dict: ``worker_peak_bytes``, ``server_peak_bytes``,
    ``overhead_bytes``, ``server_overhead_bytes``: what a worker's device and a server's host
    hold besides) do not fit ``worker_bytes`` per worker and ``server_bytes`` per server, as one
    reason: "needs 31.2 GB per worker, 24 GB available"; "" when they fit, or where a side is
    unknown (None)."""
    for key, cap, who in (
        ("worker_peak_bytes", worker_bytes, "worker"),
        ("server_peak_bytes", server_bytes, "server"),
        ("worker_final_bytes", worker_bytes, "worker for evaluate()'s whole copy"),
    ):
        peak = memory.get(key)
        overhead = memory.get("server_overhead_bytes" if who == "server" else "overhead_bytes") or 0
        if peak is not None and cap is not None and peak + overhead > cap:
            return f"needs {(peak + overhead) / GB:.3g} GB per {who}, {cap / GB:.3g} GB available"
    return ""


def refusal(strategy: str, why: str) -> str:
    """The one line that refuses ``--strategy strategy`` whose peaks do not fit (``why``:
    :func:`misfit`'s reason), naming the flags and the way out."""
    flags = "--worker-memory, --server-memory" if strategy_spec(strategy).servers else "--worker-memory"
    return (
        f"--strategy {strategy} {why} ({flags}); choose a strategy that fits (hpar profile lists them), "
        "or --force to run it anyway"
    )


def _step(m: MemoryProfile | None, profile: Profile, grads: float, scale: float = 1.0, stepped: float = 0.0) -> float:
    """The measured step term with this strategy's gradient bytes ``grads``, at ``scale`` times
    the profiled batch: the most of the forward's peak, the step's peak with these gradients,
    and the gradients with the optimizer's temporaries over the ``stepped`` bytes it updates
    (module docstring); counted (gradients plus twice the layers' outputs) for a profile
    without memory figures."""
    if m is None:
        return grads + 2 * scale * sum(l.activation_bytes for l in profile.layers)
    rest = max(0, m.step_peak_bytes - m.step_grad_bytes) * scale
    return max(m.forward_peak_bytes * scale, rest + grads, grads + m.optimizer_step_ratio * stepped)


def _split(profile: Profile, est: Estimate) -> tuple[float, float, list]:
    """(bytes the workers hold, the trainable ones among them: not frozen, the parameters on the servers)."""
    served = [p for p in profile.params if est.placement.get(p.name) == ON_SERVERS]
    names = {p.name for p in served}
    on_ar = [p for p in profile.params if p.name not in names]
    return sum(p.bytes for p in on_ar), sum(p.bytes for p in on_ar if not p.frozen), served


def _rows(p, fraction: float) -> float:
    """Bytes of ``fraction`` of p's rows with their int64 ids."""
    return fraction * p.rows * (p.bytes / p.rows + INDEX_BYTES)


def allreduce_terms(profile: Profile, cluster: ClusterSpec, est: Estimate, schedule: str = "") -> dict[str, float]:
    """Worker terms of allreduce (module docstring): the whole model, its optimizer state,
    DDP's buckets, the step."""
    m, r, total, trained = profile.memory, _ratio(profile), profile.total_bytes, profile.trainable_bytes
    return {
        "params": total,
        "optimizer": r * trained,
        "ddp_buckets": trained,
        "step": _step(m, profile, trained, stepped=trained),
        "data": m.data_bytes if m else 0,
    }


def sparse_terms(profile: Profile, cluster: ClusterSpec, est: Estimate, schedule: str = "") -> dict[str, float]:
    """Worker terms of allreduce-sparse (module docstring): DDP's buckets hold the dense part;
    the tables' rows of every worker are gathered."""
    m, r, n, total = profile.memory, _ratio(profile), cluster.workers, profile.total_bytes
    tables = [p for p in profile.trained if p.embedding_module]
    dense = profile.trainable_bytes - sum(p.bytes for p in tables)
    own = sum(_rows(p, p.alpha) for p in tables)
    gathered = sum(n * _rows(p, p.alpha) + p.union_for(n) * p.bytes for p in tables)
    if not profile.sparse_gradients_ok:
        gathered += sum(p.bytes for p in tables)
    return {
        "params": total,
        "optimizer": r * profile.trainable_bytes,
        "ddp_buckets": dense,
        "step": _step(m, profile, dense + own, stepped=dense),
        "gathered": gathered,
        "data": m.data_bytes if m else 0,
    }


def served_terms(profile: Profile, cluster: ClusterSpec, est: Estimate, schedule: str = "") -> dict[str, float]:
    """Worker terms of hybrid and ps (module docstring): the AllReduce part, the rows pulled
    from the servers (ps: dense parameters pulled whole)."""
    m, r = profile.memory, _ratio(profile)
    on_ar, trained, served = _split(profile, est)  # frozen ones: held, no gradient, state or DDP
    rows = [p for p in served if p.embedding_module]
    pulled = sum(_rows(p, p.alpha) for p in rows)
    whole = sum(p.bytes for p in served if not p.embedding_module)  # ps: dense parameters pulled whole
    return {
        "params": on_ar + whole,
        "optimizer": r * trained,
        "ddp_buckets": trained,
        "step": _step(m, profile, trained + whole + pulled, stepped=trained),
        "rows": 3 * pulled,
        "data": m.data_bytes if m else 0,
        "runtime": RUNTIME_BYTES["hybrid_worker"] if trained else 0,
    }


def server_terms(profile: Profile, cluster: ClusterSpec, est: Estimate) -> dict[str, float]:
    """The busiest server's terms under hybrid/ps (module docstring): its share of each served
    parameter (partitions go round-robin over the servers, so a server holds up to
    ceil(partitions / S) of them), r x that share of optimizer state, the pushes it holds (a
    step's of every worker but the last, which a table waits for, and the largest table's mean:
    every row of it where the update needs them all, as Adam's and momentum's exact semantics
    do, strategies/runtimes/hybrid/shard.py) with the update's temporaries, and its inbox
    (strategies/runtimes/hybrid/wire.py: INBOX_DEPTH receive buffers per worker, each as large as the
    largest request carried inline); or, where more, the whole model it
    builds at start (``build``: its rows are then cut from it, copied where other servers hold
    the rest)."""
    _, _, served = _split(profile, est)
    if not served:
        return {}
    from hpar.strategies.specs.servers_spec import INBOX_DEPTH, INLINE_MAX

    m, s, n, r = profile.memory, cluster.servers, cluster.workers, _ratio(profile)
    shard = per_worker = largest = largest_shard = inline = 0.0
    for p in served:
        parts = max(1, min(est.partitions.get(p.name, s), p.rows))
        share = -(-parts // s) / parts
        shard += share * p.bytes
        push = share * (_rows(p, p.alpha) if p.sparse else p.bytes)  # one worker's push to this server
        per_worker += push
        if push > largest:
            largest, largest_shard = push, share * p.bytes
        if push <= INLINE_MAX:  # carried in the request itself, so it lands in an inbox buffer
            inline = max(inline, push)
    # a table is applied once every worker's push of it is in: while the last worker is a step's
    # pushes behind, the others' wait in the server, then a table's mean (its every row where the
    # update needs them all)
    mean = largest if (m is None or m.rows_suffice) else largest_shard
    extra = m.model_extra_bytes if m else 0
    serving = {
        "shard": shard,
        "optimizer": r * shard,
        "pushes": (n - 1) * per_worker + largest + mean,
        "update": (m.optimizer_step_ratio if m else 0.0) * mean,
        "model_extra": extra,
        "inbox": n * INBOX_DEPTH * inline,
        "runtime": RUNTIME_BYTES["server"],
    }
    build = profile.total_bytes + extra + (shard if s > 1 else 0)
    return serving if sum(serving.values()) >= build else {"build": build}


def pipeline_terms(profile: Profile, cluster: ClusterSpec, est: Estimate, schedule: str) -> dict[str, float]:
    """The busiest pipeline stage's terms (module docstring); its activations are its layers'
    share of the saved activations at the micro-batch, times the micro-batches it holds at
    once under ``schedule`` (:func:`in_flight`)."""
    m, r, M, K = profile.memory, _ratio(profile), max(est.micro_batches, 1), len(est.stages)
    saved = (
        list(m.layer_saved_bytes) if m and sum(m.layer_saved_bytes) else [l.activation_bytes for l in profile.layers]
    )
    best: dict[str, float] = {}
    for k, (a, b) in enumerate(est.stages):
        pk = sum(l.param_bytes for l in profile.layers[a:b])
        share = sum(saved[a:b]) / max(sum(saved), 1)
        held = in_flight(schedule, K, k, M)
        # async-2bw sums each micro-batch's gradient into the batch's out of place: both at once
        terms = {
            "params": profile.total_bytes if _on_cpu(profile, cluster) else pk,
            "gradients": pk * (2 if schedule == "async-2bw" and M > 1 else 1),
            "optimizer": r * pk,
            "step": max(held * share * _step(m, profile, 0.0, 1.0 / M), m.optimizer_step_ratio * pk if m else 0),
            "versions": pk * {"async-stash": held, "async-predict": 1, "async-2bw": 2}.get(schedule, 0),
            "replica_allreduce": pk if est.replicas > 1 else 0,  # the stage's gradients flattened for it
            "data": (m.data_bytes if m else 0) if k in (0, K - 1) else 0,
            "runtime": RUNTIME_BYTES["stage"],
            "trace": m.trace_bytes if m and profile.traced and _on_cpu(profile, cluster) else 0,
        }
        if sum(terms.values()) > sum(best.values()):
            best = terms
    return best


def in_flight(schedule: str, stages: int, stage: int, micro_batches: int) -> int:
    """The most micro-batches ``stage`` holds between forward and backward under ``schedule``
    (its pass order, strategies/plan/schedules.py: GPipe M, 1F1B min(M, K - k))."""
    from hpar.strategies.plan.schedules import stage_ops

    count = micro_batches if schedule in ("gpipe", "1f1b", "torch-gpipe", "torch-1f1b") else 2 * micro_batches + stages
    name = schedule if not schedule.startswith("torch-") else schedule[len("torch-") :]
    if name not in ("gpipe", "1f1b", "async", "async-stash", "async-predict", "async-2bw"):
        name = "1f1b"
    held = most = 0
    for op in stage_ops(name, stages, stage, count):
        held += 1 if op.kind == "F" else -1
        most = max(most, held)
    return most


def _on_cpu(profile: Profile, cluster: ClusterSpec) -> bool:
    """Whether the workers compute on the host's CPU, so that what a process builds on the host
    counts against the worker's memory: profiled on a CPU and not projected to a device
    (``--device-tflops``), whose memory holds only what is moved onto it."""
    return profile.device == "cpu" and cluster.device_flops is None


def _ratio(profile: Profile) -> float:
    return profile.memory.optimizer_state_ratio if profile.memory else 1.0


def forward_passes(steps: int | None, accumulate: int | None) -> int | None:
    """The forward passes each worker runs over ``steps`` optimizer steps of ``accumulate``
    micro-steps each (None or 0: 1), the ``forwards`` of :func:`growth`; None when
    ``steps`` is unknown (None or 0)."""
    return int(steps) * int(accumulate or 1) if steps else None


def growth(m: MemoryProfile, forwards: int) -> float:
    """Bytes a worker keeps over ``forwards`` forward passes on new batches beyond its first
    (module docstring: ``growth``). Profiles without a census: the growth per profiled step
    times GROWTH_HORIZON_STEPS."""
    if not m.growth_steps:
        return 0.0
    if not m.shape_counts:
        return m.growth_bytes * GROWTH_HORIZON_STEPS / m.growth_steps
    if not m.growth_new_shapes:
        return float(m.growth_bytes)
    return m.growth_bytes / m.growth_new_shapes * max(0.0, distinct_after(m.shape_counts, forwards) - 1)


def predict(
    profile: Profile, cluster: ClusterSpec, est: Estimate, schedule: str = "1f1b", forwards: int | None = None
) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of candidate ``est`` (its placement, partitions, stages and
    micro-batches) on ``cluster``; ``schedule``: a pipeline's; ``forwards``: the forward passes
    each worker runs (steps times gradient accumulation; None: GROWTH_HORIZON_STEPS)."""
    m, spec = profile.memory, strategy_spec(est.strategy)
    worker = {} if spec.pipelined and not est.stages else spec.load("worker_memory")(profile, cluster, est, schedule)
    if worker:  # every worker process builds the model and runs its first forward inside its training
        worker["first_use"] = (m.first_use_bytes + m.model_extra_bytes) if m else 0
        worker["growth"] = growth(m, forwards or GROWTH_HORIZON_STEPS) if m else 0
    for key, term in (("cache_bytes", "cache"), ("compress_bytes", "compress")):  # hybrid-cache's rows and held
        if worker and est.breakdown.get(
            key
        ):  # gradients; --compress powersgd's error feedback and P, Q (costmodel_compress)
            worker[term] = est.breakdown[key]
    server = server_terms(profile, cluster, est) if spec.servers else {}
    # the script's evaluate() after the last step: worker 0's whole copy, where no worker holds the model whole
    final = (
        spec.load("evaluate_memory")(profile, cluster, est)
        if worker and profile.evaluates and spec.evaluate_memory
        else {}
    )
    if final:  # with what a worker keeps from training besides its parameters
        final = {**{k: worker[k] for k in LASTING if k in worker}, **final}
    return MemoryEstimate(
        {k: int(v) for k, v in worker.items()},
        {k: int(v) for k, v in server.items()},
        overhead_bytes=m.process_bytes if m else 0,
        device_overhead_bytes=m.device_overhead_bytes if m else 0,
        device="cpu" if _on_cpu(profile, cluster) else "cuda",
        final={k: int(v) for k, v in final.items()},
    )
