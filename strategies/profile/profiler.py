"""Measure a user's job on this machine: per-parameter sparsity and per-layer costs.

:func:`profile_job` returns a :class:`Profile`, the frozen value the cost model and planner read
(``strategies/plan/costmodel.py``, ``strategies/plan/planner.py``): per-layer forward/backward
time, FLOPs and bytes, each parameter's gradient sparsity (``alpha``, ``union_curve``), the
unused parameters, the optimizer's update cost, and on a GPU the host's own seconds per step.
Everything is measured on a fresh deep copy of ``job.build_model()`` (the user's model object,
its ``sparse=`` flags, the global torch RNG state and the thread count are left as they were),
with ``torch.set_num_threads(1)`` as every hpar CPU worker runs, on the workers' device
(strategies/profile/device.py); a ``torch.compile``-d model's ``net`` is profiled eagerly
(``forward.inner_module``). How each figure is measured: docs/profile.md, "How it measures".
Pipeline layers: :func:`pipeline_layers` (strategies/profile/layer_timing.py; nn.Sequential, or ``model.hpar_layers()``).

Sources: FLOPs from ``torch.utils.flop_counter.FlopCounterMode``; fused RNN kernels, which
report none there, counted analytically (2 FLOPs per multiply-add of the gate matrices,
backward = 2x forward: the usual 1:2 rule, e.g. Kaplan et al. 2020, "Scaling laws for neural
language models").
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch

from hpar.strategies.common.devices import DeviceClock
from hpar.strategies.job.contract import Job
from hpar.strategies.job.user_errors import raised_in_script, user_error
from hpar.strategies.job.forward import call_model, inner_module
from hpar.strategies.profile.device import data_seconds, OnDevice
from hpar.strategies.profile.compress_cost import profile_compression
from hpar.strategies.job.traced import TracedStage
from hpar.strategies.job.tying import dense_shared_embeddings, shared_across_stages
from hpar.strategies.job.loop import precision_context
from hpar.strategies.profile.hooks import (
    auto_timing_batch,
    fixed_share,
    LayerTimer,
    count_flops,
    traced_layer_flops,
    embedding_modules,
    rows_touched,
)
from hpar.strategies.profile.step_overhead import step_overhead_s
from hpar.strategies.profile.hot_rows import HotRows, row_counts
from hpar.strategies.profile.layer_timing import cast_loss, compose, median_or_zero, pipeline_layers, pooled_layer_times
from hpar.strategies.profile.records import LayerProfile, ParamProfile, Profile
from hpar.strategies.profile.shapes import ShapeCensus, draw
from hpar.strategies.profile import memory_profile as mem_probe
from hpar.strategies.profile.sparsity import embedding_sparsity
from hpar.strategies.profile.unused import missing_gradients, probe_unused
from hpar.strategies.profile.update import (
    dense_update_cost,
    per_tensor_update_cost,
    probe_optimizer,
    server_optimizer_problem,
    sparse_update_cost,
)
from hpar.strategies.specs.registry import FSDP

SPARSE_ROW_FRACTION = 0.1  # a non-embedding gradient touching fewer rows than this is sparse
MAX_SPARSITY_WORKERS = 16  # the workers whose batches the sparsity probe draws, at most
SKIPPABLE = frozenset({"fsdp_overhead", "hot_rows", "compression"})  # what only some plans read
NO_HOT_ROWS = HotRows((), (), 0, 0)  # a table's row frequencies, not counted


def skipped_for(strategy: str | None, cache: bool) -> frozenset[str]:
    """The measurements of :data:`SKIPPABLE` that a run forced to ``strategy`` (None: the planner
    chooses, so every one is read) does not read: FSDP2's own work unless it is fsdp, the row
    frequencies unless a cache is planned (``cache``), the compression's compute (a forced run
    weighs no ``--compress``). What that saves: BENCHMARKS.md, "Time before the first step"."""
    if strategy is None:
        return frozenset()
    return SKIPPABLE - ({"fsdp_overhead"} if strategy == FSDP.name else set()) - ({"hot_rows"} if cache else set())


def profile_job(
    job: Job,
    batch_size: int,
    workers: int,
    repeats: int = 7,
    warmup: int = 2,
    timing_batch_size: int | None = None,
    device: torch.device | str = "cpu",
    precision: str | None = None,
    compress=None,
    skip: frozenset[str] = frozenset(),
) -> Profile:
    """Profile ``job`` for ``workers`` (N) data-parallel workers of ``batch_size`` each, the
    model and batches on ``device`` (CUDA: timed with CUDA events and synchronize, see
    strategies/profile/device.py). Forward passes are timed under the workers' autocast
    (``precision``: fp32, bf16, fp16; None: the script's ``HPAR["precision"]``, else fp32),
    since bf16 on a CPU without bf16 units can be several times slower than fp32. ``compress``: a
    ``--compress`` setting whose own compute to time beside the usual ones (profile/compress_cost.py).
    ``skip``: measurements of :data:`SKIPPABLE` not taken (:func:`skipped_for`); the Profile then
    holds what it holds for "not measured" (``fsdp_overhead_s`` and ``compress_s`` None, no hot rows).

    Returns a :class:`Profile` (see the module docstring for the method). Raises JobError
    when the user's functions fail, ValueError for a non-positive ``batch_size``,
    ``workers`` or ``repeats``. Typically a few seconds for small models.
    """
    if batch_size < 1 or workers < 1 or repeats < 1:
        raise ValueError(f"--batch-size, --gpus and repeats must be at least 1, got {batch_size}, {workers}, {repeats}")
    assert skip <= SKIPPABLE, skip
    t_start = time.perf_counter()
    cast = precision_context(precision or job.defaults.get("precision") or "fp32", torch.device(device).type)
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        dev = torch.device(device)
        clock, on_dev = DeviceClock(dev), OnDevice(job, dev)
        built = job.build_model()
        model = copy.deepcopy(inner_module(built)).to(dev).train()  # a compiled model: see the module docstring
        embs = embedding_modules(model)
        for _, m in embs:
            m.sparse = True  # profile copy only: cheap gradients for huge tables
        tbs = min(timing_batch_size or batch_size, batch_size)
        if timing_batch_size is None:
            tbs = auto_timing_batch(on_dev, model, batch_size, workers)
        batches = on_dev.batches(0, workers, tbs)
        timed = [next(batches) for _ in range(warmup + repeats)]
        layers, is_seq, reason = pipeline_layers(model, [x for x, _ in timed])
        traced = is_seq and isinstance(layers[0][1], TracedStage)
        run = (lambda x: compose(layers, x)) if traced else (lambda x: call_model(model, x))
        timer = LayerTimer(layers, [m for _, m in embs], clock)
        fwd, bwd, lay_f, lay_b, grad_rows, unused = [], [], [], [], {}, set()
        with timer:
            for i, (inputs, targets) in enumerate(timed):
                model.zero_grad(set_to_none=True)
                timer.reset()
                t0 = clock.mark()
                with cast():
                    loss = job.compute_loss(run(inputs), targets)
                t1 = clock.mark()
                loss.backward()
                t2 = clock.mark()
                unused |= missing_gradients(model)
                if i == warmup - 1:
                    growth = mem_probe.Growth(model, dev)  # what the timed steps keep (profile/memory_profile.py)
                if i < warmup:
                    continue
                fwd.append(clock.between(t0, t1))
                bwd.append(clock.between(t1, t2))
                lay_f.append(timer.forward_s())
                lay_b.append(timer.backward_s(t2))
                for name, p in model.named_parameters():
                    if p.grad is not None and p.dim() >= 2 and not p.grad.is_sparse:
                        grad_rows.setdefault(name, []).append(rows_touched(p.grad))
            calls_once = timer.embedding_calls_once()
            kept = growth.bytes() if warmup else 0
        # the shapes the timed steps met, counted in passes of their own after them: a census's
        # hooks on every module would add microseconds a module to the measured compute
        new_shapes = 0
        with ShapeCensus(model) as census, torch.no_grad():
            for i, (inputs, targets) in enumerate(timed):
                cast_loss(job, cast, run, inputs, targets)
                new_shapes += census.record() and i >= warmup
        grown = (kept, repeats, new_shapes) if warmup else (0, 0, 0)
        with ShapeCensus(model) as met:  # the shapes a worker meets at the run's batch (profile/shapes.py);
            whole = lambda x: call_model(model, x)  # the model itself: a traced graph keeps the timing batch's shapes
            draw(met, lambda b: cast_loss(job, cast, whole, *b), on_dev.batches(0, workers, batch_size))
        inputs, targets = timed[-1]
        step_mem = mem_probe.step_memory(
            model, [m for _, m in layers], lambda: cast_loss(job, cast, run, inputs, targets), dev
        )
        model.zero_grad(set_to_none=True)
        flops = count_flops(model, [] if traced else layers, lambda: job.compute_loss(run(inputs), targets))
        if traced:
            flops["layers"] = traced_layer_flops(layers, inputs)
        scale = batch_size / tbs
        ranks = probe_unused(job, min(batch_size, max(tbs, 2)), workers, 3, model, batches=on_dev.batches)
        emb_stats = embedding_sparsity(
            on_dev, model, embs, batch_size, workers, MAX_SPARSITY_WORKERS, stop_early=calls_once
        )
        samples = emb_stats.pop("__samples__")
        hot = {} if "hot_rows" in skip else row_counts(on_dev, model, embs, batch_size, workers, stop_early=calls_once)
        fixed = fixed_share(on_dev, model, tbs, workers)
        data_s = data_seconds(on_dev, batch_size, workers)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        update = dense_update_cost(job, model_bytes, device=dev)
        per_tensor = per_tensor_update_cost(job, device=dev)
        host_per_tensor = per_tensor_update_cost(job) if dev.type != "cpu" else None
        fsdp_overhead = None
        if "fsdp_overhead" not in skip:
            fsdp_overhead = FSDP.load("profile_probe")(job, dev, cast, timed, model_bytes)
        compress_s = None
        if "compression" not in skip:
            compress_s = profile_compression(
                model, {f"{n}.weight" if n else "weight" for n, _ in embs}, dev, workers, compress
            )
        tensors = sum(1 for _ in model.parameters())
        # at the timing batch, as forward and backward were timed (the host's own seconds hardly depend on it)
        charged = data_s + median_or_zero(fwd) + median_or_zero(bwd) + update * model_bytes + per_tensor * tensors
        host_overhead = step_overhead_s(job, dev, cast, tbs, workers, charged, model_bytes)
        host_update = dense_update_cost(job, model_bytes) if dev.type != "cpu" else None
        sparse_update, sparse_ok = None, True
        if embs:
            name, table = max(((n, m.weight) for n, m in embs), key=lambda nm: nm[1].numel())
            key = f"{name}.weight" if name else "weight"
            sparse_update = sparse_update_cost(
                job, table.shape[0], table.shape[1], emb_stats[key]["alpha"], workers, device=dev
            )
            sparse_ok = sparse_update is not None
        server_note = server_optimizer_problem(job, model)
        data_mem = mem_probe.data_bytes(on_dev, batch_size, workers)
        state_ratio = mem_probe.optimizer_ratios(lambda ps: probe_optimizer(job, ps), dev)
    except Exception as exc:  # the user's code failed here though check_job passed (e.g. only on the GPU)
        if not raised_in_script(job, exc):
            raise
        raise user_error(job, exc, "the model", f"while profiling on {device}") from exc
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)

    layer_of = {}
    for li, (_, m) in enumerate(layers):
        for p in m.parameters():
            layer_of.setdefault(id(p), li)
    emb_names = {f"{n}.weight" if n else "weight" for n, _ in embs}
    tied = {n: tuple(q for q in held if q != n) for n, held in dense_shared_embeddings(model).items()}
    params = []
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name in emb_names:
            st = emb_stats[name]
            h = hot.get(name, NO_HOT_ROWS)
            pp = ParamProfile(
                name,
                tuple(p.shape),
                nbytes,
                True,
                st["alpha"],
                st["union"],
                True,
                layer_of.get(id(p), -1),
                st["curve"],
                st["mass"],
                st["dedup_s"],
                h.ids,
                h.counts,
                h.batches,
                h.touches,
                lookups=st["lookups"],
                bags=st["bags"],
            )
        elif name in grad_rows and median_or_zero([f for f, _ in grad_rows[name]]) < SPARSE_ROW_FRACTION:
            fr = [f for f, _ in grad_rows[name]]
            union = float(torch.stack([m for _, m in grad_rows[name]]).any(0).float().mean())
            pp = ParamProfile(
                name,
                tuple(p.shape),
                nbytes,
                True,
                float(sum(fr) / len(fr)),
                union,
                False,
                layer_of.get(id(p), -1),
                ((len(fr), union),),
                tied_to=tied.get(name, ()),
            )
        else:
            pp = ParamProfile(
                name,
                tuple(p.shape),
                nbytes,
                False,
                1.0,
                1.0,
                False,
                layer_of.get(id(p), -1),
                tied_to=tied.get(name, ()),
            )
        params.append(dataclasses.replace(pp, frozen=not p.requires_grad))
    params.sort(key=lambda q: (not q.sparse, -q.bytes))
    lp = []
    fwd_of, bwd_of = pooled_layer_times(layers, timer.activation_bytes, lay_f, lay_b)
    for li, (name, m) in enumerate(layers):
        lp.append(
            LayerProfile(
                name=name,
                forward_s=fwd_of[li] * scale,
                backward_s=bwd_of[li] * scale,
                flops=int(flops["layers"][li] * scale),
                activation_bytes=int(timer.activation_bytes[li] * scale),
                param_bytes=sum(q.numel() * q.element_size() for q in m.parameters()),
            )
        )
    f_s, b_s = median_or_zero(fwd) * scale, median_or_zero(bwd) * scale
    return Profile(
        params=tuple(params),
        layers=tuple(lp),
        batch_size=batch_size,
        samples_per_batch=samples,
        workers=workers,
        is_sequential=is_seq,
        sequential_reason=reason,
        compute_s=f_s + b_s,
        forward_s=f_s,
        backward_s=b_s,
        forward_flops=int(flops["forward"] * scale),
        backward_flops=int(flops["backward"] * scale),
        update_s_per_byte=update,
        update_s_per_tensor=per_tensor,
        host_update_s_per_tensor=host_per_tensor,
        fsdp_overhead_s=fsdp_overhead,
        compress_s=compress_s,
        step_overhead_s=host_overhead,
        timing_batch_size=tbs,
        profile_s=time.perf_counter() - t_start,
        sparse_update_s_per_byte=sparse_update,
        sparse_gradients_ok=sparse_ok,
        fixed_share=fixed,
        device=dev.type,
        host_update_s_per_byte=host_update,
        data_s=data_s,
        unused_params=tuple(sorted(unused.union(ranks.params))),
        unused_by_rank=ranks.by_rank,
        server_optimizer_note=server_note,
        traced=traced,
        evaluates=job.evaluate_fn is not None,
        memory=mem_probe.memory_profile(step_mem, tbs, data_mem, state_ratio, job, dev, grown, met.counts()).scaled(
            batch_size
        ),
        shared_params=tuple(
            (n, held) for n, (held, _) in shared_across_stages(layers, [(i, i + 1) for i in range(len(layers))]).items()
        )
        if is_seq
        else (),
    )
