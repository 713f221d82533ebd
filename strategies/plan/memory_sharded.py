"""Worker memory of the strategies whose workers hold no whole model (notation and terms:
strategies/plan/memory_model.py): FSDP's training terms (a worker's shards and the units it
gathers, :func:`fsdp_terms`), and worker 0's terms after the last step where the script's
``evaluate()`` needs a whole copy: FSDP gathers the shards to its host and loads them into a
freshly built model (:func:`fsdp_final_terms`); hybrid and ps pull the served parameters into a
copy (:func:`served_final_terms`). That copy is what ``final_peak_bytes`` measures
(strategies/common/measured_memory.open_final_window) and what the memory model checks against
``--worker-memory`` beside the training peak (memory_model.MemoryEstimate.final). A script
without ``evaluate()`` gets no copy (workers/worker.py turns evaluation off), and the
strategies whose workers hold the whole model (allreduce, pipelines) make none beyond it."""

from __future__ import annotations

from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.costmodel import Estimate
from hpar.strategies.plan.memory_model import RUNTIME_BYTES, _on_cpu, _ratio, _split, _step
from hpar.strategies.profile.records import Profile


def fsdp_terms(
    profile: Profile, cluster: ClusterSpec, est: Estimate | None = None, schedule: str = ""
) -> dict[str, float]:
    """An FSDP worker's terms (memory_model's docstring): shards of parameters, gradients and optimizer
    state (P/N each), the two largest adjacent units gathered (the one running and the one
    prefetched) and the root's parameters (:func:`fsdp_units`), with their unsharded gradients,
    the step's activations, and on a CPU the whole model built before sharding (a transient the
    training terms usually exceed)."""
    m, r, n, total = profile.memory, _ratio(profile), cluster.workers, profile.total_bytes
    units, root = fsdp_units(profile)
    pairs = max((a + b for a, b in zip(units, units[1:])), default=units[0] if units else 0)
    shard, trained = total / n, profile.trainable_bytes / n  # frozen parameters: sharded, no gradient or state
    train = {
        "params": shard,
        "optimizer": r * trained,
        "unsharded": 2 * (root + pairs),
        "step": _step(m, profile, trained, stepped=trained),
        "data": m.data_bytes if m else 0,
        "runtime": RUNTIME_BYTES["fsdp"],
    }
    build = total + shard if _on_cpu(profile, cluster) else 0
    if build > sum(train.values()):
        return {"build": build}
    return train


def fsdp_units(profile: Profile) -> tuple[list[int], int]:
    """(parameter bytes of each unit strategies/runtimes/dataparallel/fsdp.py shards on its own, bytes the root keeps):
    a declared sequence's layers and nothing; a traced model's repeated blocks (its layers but the
    first and the last) and those two; any other model one root holding everything, which FSDP
    gathers whole for the step."""
    sizes = [l.param_bytes for l in profile.layers]
    if profile.is_sequential and not profile.traced:
        return sizes, 0
    if profile.is_sequential and len(sizes) > 2:
        return sizes[1:-1], sizes[0] + sizes[-1]
    return [], profile.total_bytes


def fsdp_final_terms(profile: Profile, cluster: ClusterSpec, est: Estimate) -> dict[str, float]:
    """Worker 0's terms after the last step while FSDP's shards become ``evaluate()``'s whole
    copy: its shards and their optimizer state (P/N and r P/N), the gathered state dict (P) and
    the model built to load it (P)."""
    total = profile.total_bytes
    shard = total / max(cluster.workers, 1)
    trained = profile.trainable_bytes / max(cluster.workers, 1)  # frozen parameters have no optimizer state
    return {"params": shard, "optimizer": _ratio(profile) * trained, "gathered": total, "copy": total}


def served_final_terms(profile: Profile, cluster: ClusterSpec, est: Estimate) -> dict[str, float]:
    """Worker 0's terms while it builds ``evaluate()``'s copy under hybrid or ps
    (strategies/runtimes/hybrid/worker_state.model_copy): what it holds (the AllReduce part, its
    optimizer state, under ps the dense parameters pulled whole) and the copy: the model's own
    parameters, the served dense ones pulled, and the served tables pulled whole when together
    they are at most EVAL_WHOLE_BYTES (else they stay served, row by row)."""
    from hpar.strategies.specs.servers_spec import EVAL_WHOLE_BYTES

    on_ar, trained, served = _split(profile, est)
    dense = sum(p.bytes for p in served if not p.embedding_module)
    tables = sum(p.bytes for p in served if p.embedding_module)
    pulled = tables if tables <= EVAL_WHOLE_BYTES else 0
    return {"params": on_ar + dense, "optimizer": _ratio(profile) * trained, "copy": on_ar + dense + pulled}
