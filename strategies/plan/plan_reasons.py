"""Why the planner (strategies/plan/planner.py) chose its plan: the tie rule (predictions within
``TIE`` of the fastest go to the simplest strategy) and the one-line reason each plan carries,
in the words of the model (embedding tables and their sparsity, tied weights) and the cluster."""

from __future__ import annotations

from hpar.strategies.job.compression import Compression
from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.costmodel import Estimate
from hpar.strategies.plan.costmodel_cache import NAME as CACHED
from hpar.strategies.profile.records import Profile
from hpar.strategies.specs.registry import ALLREDUCE, FSDP, HYBRID, PIPELINE, spec as strategy_spec
from hpar.strategies.specs.torchrec_spec import SHARDINGS as TORCHREC_SHARDINGS


def fmt_bytes(n: float) -> str:
    """``n`` bytes in words: "512 B", "1.5 MB"."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def tied_share(profile: Profile) -> tuple[float, str]:
    """(the share of the parameter bytes in embedding tables tied to a dense layer, their ties as
    words: "transformer.wte.weight tied to lm_head.weight"; "" when there are none)."""
    tied = [p for p in profile.params if p.tied_to]
    words = "; ".join(f"{p.name} tied to {', '.join(p.tied_to)}" for p in tied[:2]) + ("; ..." if len(tied) > 2 else "")
    return sum(p.bytes for p in tied) / max(profile.total_bytes, 1), words


def dense_why(share: float, profile: Profile) -> str:
    """Why the gradients are dense, in the allreduce reason: the share of the bytes in row-sparse
    embedding tables, and the tables whose tie to a dense layer makes their gradients dense."""
    tied, words = tied_share(profile)
    if not words:
        return f"the gradients are dense ({share:.0%} of the bytes in embedding tables)"
    if not share:
        return (
            f"the gradients are dense: {tied:.0%} of the bytes are in embedding tables, all tied to a dense "
            f"layer ({words}), so their gradients are dense"
        )
    sparse = f"{share:.1%}" if share < 0.01 else f"{share:.0%}"
    return (
        f"the gradients are mostly dense: {share + tied:.0%} of the bytes are in embedding tables, {sparse} in "
        f"row-sparse ones; the others are tied to a dense layer ({words}), so their gradients are dense"
    )


def tied_note(profile: Profile) -> str:
    """ ": a tied to b, so its gradient is dense" where the model has embedding tables tied to a
    dense layer; "" otherwise."""
    words = tied_share(profile)[1]
    one = sum(1 for p in profile.params if p.tied_to) == 1
    return f": {words}, so {'its gradient is' if one else 'their gradients are'} dense" if words else ""


def plan_reason(best: Estimate, profile: Profile, cluster: ClusterSpec, runner_up: Estimate | None) -> str:
    """The plan's reason: why ``best`` (the chosen estimate) suits ``profile`` on ``cluster``, and its
    predicted speed beside ``runner_up`` (a tie named as such)."""
    sparse = [p for p in profile.params if p.embedding_module]
    share = sum(p.bytes for p in sparse) / max(profile.total_bytes, 1)
    vs = (
        (f", {best.samples_per_s / runner_up.samples_per_s:.2f}x the predicted samples/s of {runner_up.strategy}")
        if runner_up and runner_up.samples_per_s > 0
        else ""
    )
    tie = bool(vs) and best.samples_per_s < runner_up.samples_per_s  # fastest_simplest's tie rule
    if tie:
        vs = (
            f"; taken though {runner_up.strategy} is predicted faster ({best.samples_per_s / runner_up.samples_per_s:.2f}x "
            f"its samples/s): within {TIE:.0%} of the fastest, the "
            + ("uncompressed" if " --compress " in runner_up.strategy else "simpler")
            + " plan wins (a tie: the cost model is not finer than that)"
        )
    if best.strategy == HYBRID.name:
        a = max(p.alpha for p in sparse) if sparse else 0
        return (
            f"hybrid: embedding tables hold {share:.0%} of the parameter bytes and a batch touches "
            f"at most {a:.2%} of their rows, so the servers move only touched rows while dense "
            f"gradients use AllReduce{vs}."
        )
    if best.strategy == CACHED:
        return (
            f"hybrid with hot-row caches (--staleness): a worker reads the hottest rows from its cache "
            f"{best.breakdown.get('hit_rate', 0):.0%} of the time (predicted), pulling and pushing fewer rows{vs}."
        )
    if best.strategy == PIPELINE.name and best.replicas > 1:
        return (
            f"pipeline: {len(best.stages)} stages x {best.replicas} replicas: each replica AllReduce moves only "
            f"a stage's share of the {fmt_bytes(profile.total_bytes)} of parameters, and the stages "
            f"exchange activations{vs}."
        )
    if best.strategy == PIPELINE.name:
        return (
            f"pipeline: {fmt_bytes(profile.total_bytes)} of parameters would cross a "
            f"{fmt_bytes(cluster.bandwidth_Bps)}/s link every step with data parallelism, while "
            f"the {len(best.stages)} stages only exchange activations{vs}."
        )
    if best.strategy in TORCHREC_SHARDINGS:
        return (
            f"{best.strategy}: TorchRec's all-to-alls send {fmt_bytes(best.bytes_per_step)} per worker per step "
            f"(the ids, and the looked-up or pooled rows and their gradients, not the touched rows; "
            f"{best.note}){vs}."
        )
    if best.strategy == FSDP.name:
        return (
            f"fsdp: each worker holds 1/{cluster.workers} of the {fmt_bytes(profile.total_bytes)} of parameters, "
            f"of their gradients and of the optimizer state, gathering one layer's weights at a time{vs}."
        )
    if best.strategy == ALLREDUCE.name and cluster.workers == 1:
        return (
            f"allreduce: one worker, so no gradient is exchanged and the plan without servers "
            f"or stages is the single-device step{vs}."
        )
    if best.strategy == ALLREDUCE.name and share >= 0.5:
        return (
            f"allreduce: embedding tables hold {share:.0%} of the parameter bytes, but AllReduce of "
            f"{fmt_bytes(profile.trainable_bytes)}, overlapped with backward, is predicted faster "
            f"than moving their touched rows{vs}."
        )
    if best.strategy == ALLREDUCE.name:
        return (
            f"allreduce: {dense_why(share, profile)}, and AllReduce of {fmt_bytes(profile.trainable_bytes)} "
            f"overlaps backward{vs}."
        )
    if tie:
        return f"{best.strategy}: the simplest plan predicted within {TIE:.0%} of the fastest{vs}."
    return f"{best.strategy}: the fastest predicted step that can run{vs}."


TIE = 0.05  # predictions within 5% of each other are a tie (the cost model is not finer than that)


def fastest_simplest(estimates: list[Estimate], compressed: dict | None = None) -> Estimate:
    """The estimate with the highest predicted samples/s, except that among those within
    ``TIE`` (relative) of it an uncompressed estimate is taken before any in ``compressed``
    ({id(estimate): Compression}: no accuracy trade for a gain the model cannot resolve), then
    the simplest strategy (the lowest ``StrategySpec.simplicity``: fewer moving parts, no
    servers or stages)."""
    top = max(e.samples_per_s for e in estimates)
    near = [e for e in estimates if e.samples_per_s >= top * (1 - TIE)]
    return min(
        near, key=lambda e: (id(e) in (compressed or {}), strategy_spec(e.strategy).simplicity, -e.samples_per_s)
    )


def compressed_why(best: Estimate, c: Compression, plain: list[Estimate], runner_up: Estimate | None) -> str:
    """The reason of a plan with ``--compress c``: what it saves and its speed beside the same
    strategy uncompressed (``plain``: the runnable uncompressed estimates) and the runner-up."""
    same = next((e for e in plain if e.strategy == best.strategy), None)
    vs = []
    if same is not None and same.samples_per_s > 0:
        vs.append(
            f"{best.samples_per_s / same.samples_per_s:.2f}x the predicted samples/s of {best.strategy} uncompressed"
        )
    if runner_up is not None and runner_up.strategy != best.strategy and runner_up.samples_per_s > 0:
        vs.append(f"{best.samples_per_s / runner_up.samples_per_s:.2f}x that of the runner-up, {runner_up.strategy}")
    return (
        f"{best.strategy} with --compress {c} (asked for; compression changes the numbers): "
        f"{best.note.split(';')[0].split(': ', 1)[-1]}" + (", " + ", ".join(vs) if vs else "") + "."
    )
