"""Cost model of ``--compress`` (strategies/job/compression.py): a strategy whose dense
gradients go through DDP's AllReduce (spec ``compress_hooks``), with that AllReduce compressed.

Bytes: the dense AllReduce's parameters (placed on AllReduce, trained, and not an embedding
table that ``allreduce-sparse`` exchanges as sparse rows) put their compressed size on the ring
instead of their own: half for fp16/bf16; for PowerSGD rank R, ``(n + m) R`` elements per
n x m matrix it compresses, vectors and small matrices whole
(:func:`~hpar.strategies.job.compression.wire_elements`).

Seconds: the AllReduce's exposed time (what backward does not hide: all of it on busy cores)
is taken out and the compressed one's put in: one AllReduce of the compressed bytes for
fp16/bf16, three for PowerSGD (the uncompressed tensors, then P, then Q, one after the other:
torch's ``powerSGD_hook``), each with the ring's fixed costs. The compression's own work is
added to the step as the profile measured it on the workers' device (strategies/profile/
compress_cost.py, dense layers and embedding tables apart), apportioned to the parameters this
strategy compresses by their share of the estimated work (FLOPs plus elements), scaled as the
profile's compute is on shared cores. Without a measurement (an older profile, a table too large
to time, a projected ``--device-tflops``): PowerSGD's FLOPs
(:func:`~hpar.strategies.job.compression.powersgd_flops`) at the model's own FLOP rate (or the
roofline) plus its error feedback at the update rate per byte, a 16-bit cast at half that;
``breakdown["compress_measured"]`` says which (1.0: measured). Compression pays only where
communication dominates (Agarwal et al., MLSys 2022), which this model says per job.

Memory (strategies/plan/memory_model.py, term ``compress``): PowerSGD's error-feedback buffer
(as large as the compressed gradients) and its warm-start P and Q factors, in
``breakdown["compress_bytes"]``.
"""

from __future__ import annotations

import dataclasses
import math

from hpar.strategies.job.compression import (
    Compression,
    compressed_bytes,
    compression_work,
    powersgd_buffers,
    powersgd_flops,
    wire_elements,
)
from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.costmodel import Estimate, cost_setting, cpu_share
from hpar.strategies.profile.records import ParamProfile, Profile
from hpar.strategies.specs.base import ON_ALLREDUCE
from hpar.strategies.specs.registry import spec as strategy_spec


def dense_allreduce_params(profile: Profile, est: Estimate) -> list[ParamProfile]:
    """The parameters whose gradients candidate ``est`` averages with DDP's dense AllReduce."""
    spec = strategy_spec(est.strategy)
    return [
        p
        for p in profile.params
        if not p.frozen
        and est.placement.get(p.name, ON_ALLREDUCE) == ON_ALLREDUCE
        and not (spec.sparse_gradients and p.embedding_module)
    ]


def _ring(n: int) -> float:
    return 2 * (n - 1) / n if n > 1 else 0.0


def estimate_compressed(profile: Profile, cluster: ClusterSpec, base: Estimate, c: Compression) -> Estimate:
    """``base`` (an estimate of a strategy with ``compress_hooks``) with its dense AllReduce
    compressed by ``c`` (module docstring): the same strategy name, fewer bytes, the step's
    seconds moved by the AllReduce saved and the compression's work, and the extra memory in
    ``breakdown["compress_bytes"]``; ``note`` names the compression. Raises AssertionError for a
    strategy without DDP's AllReduce (the caller asks the spec)."""
    spec = strategy_spec(base.strategy)
    assert spec.compress_hooks and c.on, (base.strategy, c)
    if not base.feasible:
        return base
    params = dense_allreduce_params(profile, base)
    shapes = [tuple(p.shape) for p in params]
    full = float(sum(p.bytes for p in params))
    numel = sum(math.prod(s) for s in shapes)
    per_elem = full / numel if numel else 4.0  # the gradients' width (fp32: 4)
    small = float(numel * 2) if c.kind in ("fp16", "bf16") else compressed_bytes(shapes, c) * per_elem / 4.0
    cs = cost_setting(profile, cluster, with_servers=spec.servers)
    if c.kind == "powersgd":
        pieces = _powersgd_pieces(shapes, c, per_elem)
        ar_small = sum(cs.allreduce(b) for b in pieces if b > 0)
        flops = powersgd_flops(shapes, c)
        per_flop = (cs.fwd + cs.bwd) / profile.flops if profile.flops else 0.0
        work = (
            cluster.device.seconds(flops, 4.0 * full) if cluster.device is not None else flops * per_flop
        ) + full * cs.update_per_byte  # error feedback: add, copy, subtract over the gradients
    else:
        ar_small, work = cs.allreduce(small), 0.5 * full * cs.update_per_byte  # the 16-bit casts
    measured = measured_work(profile, params, c) if cluster.device is None else None
    if measured is not None:
        work = cpu_share(cluster) * measured
    ar_full = cs.allreduce(full)
    exposed = (lambda ar: max(cs.bwd, ar) - cs.bwd) if cs.overlap else (lambda ar: ar)
    saved = exposed(ar_full) - exposed(ar_small) if cs.n > 1 else 0.0
    step = max(1e-9, base.step_s - saved + work)
    sent = max(0.0, base.bytes_per_step - _ring(cs.n) * (full - small))
    error, factors = powersgd_buffers(shapes, c)
    breakdown = {
        **base.breakdown,
        "compress_saved": saved,
        "compress_work": work,
        "compress_measured": float(measured is not None),
        "compress_bytes": (error + factors) * per_elem / 4.0,
    }
    note = f"--compress {c}: {small / full:.2f}x the dense AllReduce's bytes" if full else f"--compress {c}"
    return dataclasses.replace(
        base, step_s=step, bytes_per_step=sent, breakdown=breakdown, note=note + ("; " + base.note if base.note else "")
    )


def measured_work(profile: Profile, params: list[ParamProfile], c: Compression) -> float | None:
    """The profile's measured seconds per step of ``c``'s own compute (one thread, the profile's
    device) for the gradients of ``params``: the dense layers' and the embedding tables'
    measurements, each times the share of ``params`` in its estimated work (FLOPs plus
    elements: ``compression_work``). None where the profile has none for ``c``, or ``params`` hold a
    table it could not measure."""
    got = profile.compression_s(str(c))
    if got is None:
        return None
    total = 0.0
    for measured_s, tables in zip(got, (False, True)):
        part = [p for p in params if p.embedding_module == tables]
        if not part:
            continue
        if measured_s < 0:
            return None
        whole = compression_work([tuple(p.shape) for p in profile.trained if p.embedding_module == tables], c)
        total += measured_s * (compression_work([tuple(p.shape) for p in part], c) / whole if whole else 1.0)
    return total


def _powersgd_pieces(shapes: list[tuple[int, ...]], c: Compression, per_elem: float) -> tuple[float, float, float]:
    """Bytes of PowerSGD's three AllReduces per step: the tensors it sends whole, P, Q."""
    whole = p_bytes = q_bytes = 0.0
    for s in shapes:
        elems, numel = wire_elements(s, c)[0], math.prod(s)
        if len(s) >= 2 and elems < numel:
            n, m = s[0], numel // s[0]
            r = min(n, m, c.rank)
            p_bytes, q_bytes = p_bytes + n * r * per_elem, q_bytes + m * r * per_elem
        else:
            whole += numel * per_elem
    return whole, p_bytes, q_bytes


ROW = " --compress "  # a compressed candidate's name: "<strategy> --compress <setting>"


def is_compressed_row(name: str) -> bool:
    """Whether planner candidate ``name`` is a compressed row of :func:`shown_rows` (its
    strategy's checks are the uncompressed row's)."""
    return ROW in name


SHOWN = (Compression("fp16"), Compression("powersgd", 2))  # the rows `hpar profile` shows without --compress


def shown_rows(
    profile: Profile,
    cluster: ClusterSpec,
    estimates: list[Estimate],
    candidates: list,
    memory,
    asked: Compression | None = None,
) -> tuple[list, list[tuple[Estimate, Compression]]]:
    """``hpar profile``'s compressed rows, beside ``candidates`` (the planner's Candidates, in
    the order of ``estimates``), and those the planner may choose. After each available
    candidate of a strategy with DDP's AllReduce, one row per compression of :data:`SHOWN`
    (and ``asked``, the user's ``--compress``, where it is another), named ``"<strategy>
    --compress <c>"``. Compression trades accuracy, so a row is runnable only for the setting
    the user asked for, and only where its predicted memory fits (``memory(est)``: the
    planner's MemoryEstimate of an estimate). Returns (the rows, [(its estimate, its setting)
    for each runnable compressed row])."""
    from hpar.strategies.specs.decision import Candidate

    asked = asked if asked is not None and asked.on else None
    settings = SHOWN + ((asked,) if asked is not None and asked not in SHOWN else ())
    by_name = {e.strategy: e for e in estimates}
    out, runnable = [], []
    for cand in candidates:
        out.append(cand)
        e = by_name.get(cand.strategy)
        spec = strategy_spec(cand.strategy) if e is not None else None
        if e is None or not e.feasible or not cand.available or not spec.compress_hooks or spec.runs_as:
            continue
        for c in settings:
            ce = estimate_compressed(profile, cluster, e, c)
            mem = memory(ce)
            misfit = mem.misfit(cluster)
            why = (
                (misfit or "asked for with --compress: an accuracy trade")
                if c == asked
                else f"an accuracy trade: runs with hpar run --strategy {e.strategy} --compress {c}"
            )
            out.append(
                Candidate(
                    f"{e.strategy}{ROW}{c}",
                    ce.step_s,
                    ce.samples_per_s,
                    ce.bytes_per_step,
                    c == asked and not misfit,
                    f"{ce.note.split(';')[0]}; {why}",
                    dict(ce.breakdown),
                    mem.to_dict(cluster),
                )
            )
            if c == asked and not misfit:
                runnable.append((ce, c))
    return out, runnable


__all__ = ["estimate_compressed", "dense_allreduce_params", "measured_work", "shown_rows", "SHOWN", "is_compressed_row"]
