"""A memory-only profile, for ``hpar run`` with a strategy named explicitly: it starts without
the planner (no timing, no link probe), yet its plan must be checked against the workers'
memory before anything starts and its predicted peak recorded beside the measured one.

:func:`memory_only_profile` measures what strategies/plan/memory_model.py reads, in one step on a copy
of the model the pre-start check built: the step's peaks and the activations each layer saves
(strategies/profile/memory_profile.py), ``data()``'s memory, the optimizer's state per parameter byte,
and per embedding table the fraction of rows rank 0's batch touched (``alpha``; the union over
N workers is taken as N times it, at most every row), and what a few more steps on new batches
keep (``growth_bytes``, up to GROWTH_STEPS steps within GROWTH_BUDGET_S). Every timing figure
of the returned Profile is 0: it prices no step. A fraction of a second for the models of the
tests and examples.
"""

from __future__ import annotations

import copy
import time

import torch

from hpar.strategies.job.forward import call_model, inner_module
from hpar.strategies.job.layers import is_declared_sequence, model_layers
from hpar.strategies.job.loop import precision_context
from hpar.strategies.profile import memory_profile as mem_probe
from hpar.strategies.profile.device import OnDevice
from hpar.strategies.profile.hooks import embedding_modules
from hpar.strategies.profile.records import LayerProfile, ParamProfile, Profile
from hpar.strategies.profile.shapes import ShapeCensus, draw

GROWTH_STEPS = 6  # steps on new batches after the measured one, for growth_bytes
GROWTH_BUDGET_S = 2.0  # ... fewer where the steps take longer than this


def memory_only_profile(
    job, model: torch.nn.Module, batch_size: int, workers: int, device: torch.device, precision: str | None = None
) -> Profile:
    """The Profile of ``job`` at ``batch_size`` per worker for ``workers`` workers with only its
    memory figures measured (module docstring), on a copy of ``model`` (left as it was, its RNG
    and thread count too) on ``device``. Raises JobError from the user's code."""
    cast = precision_context(precision or job.defaults.get("precision") or "fp32", device.type)
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        net = copy.deepcopy(inner_module(model)).to(device).train()
        embs = embedding_modules(net)
        for _, m in embs:
            m.sparse = True
        on_dev = OnDevice(job, device)
        batches = on_dev.batches(0, workers, batch_size)
        layers = model_layers(net) if is_declared_sequence(net) else list(net.named_children())

        def forward(batch):
            with cast():
                return job.compute_loss(call_model(net, batch[0]), batch[1])

        first = next(batches)
        step = mem_probe.step_memory(net, [m for _, m in layers], lambda: forward(first), device)
        alphas = {n: _alpha(p) for n, p in net.named_parameters()}  # the first step's touched rows
        with ShapeCensus(net) as census:  # kernels' caches for new shapes (profile/shapes.py)
            with torch.no_grad():
                forward(first)
            census.record()
            growth, t0, ran, new = mem_probe.Growth(net, device), time.perf_counter(), 0, 0
            for _ in range(GROWTH_STEPS):
                if time.perf_counter() - t0 > GROWTH_BUDGET_S:
                    break
                forward(next(batches)).backward()
                ran, new = ran + 1, new + census.record()
            grown = (growth.bytes(), ran, new)
            draw(census, forward, batches)
        data = mem_probe.data_bytes(on_dev, batch_size, workers)
        ratio = mem_probe.optimizer_ratios(lambda ps: job.build_optimizer(ps, lr=1e-3), device)
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    tables = {f"{n}.weight" if n else "weight" for n, _ in embs}
    layer_of = {id(p): i for i, (_, m) in enumerate(layers) for p in m.parameters()}
    params = []
    for name, p in net.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name in tables:
            alpha = alphas[name]
            params.append(
                ParamProfile(
                    name,
                    tuple(p.shape),
                    nbytes,
                    True,
                    alpha,
                    min(1.0, workers * alpha),
                    True,
                    layer_of.get(id(p), -1),
                    frozen=not p.requires_grad,
                )
            )
        else:
            params.append(
                ParamProfile(
                    name,
                    tuple(p.shape),
                    nbytes,
                    False,
                    1.0,
                    1.0,
                    False,
                    layer_of.get(id(p), -1),
                    frozen=not p.requires_grad,
                )
            )
    lp = tuple(
        LayerProfile(n, 0.0, 0.0, 0, 0, sum(q.numel() * q.element_size() for q in m.parameters())) for n, m in layers
    )
    memory = mem_probe.memory_profile(step, batch_size, data, ratio, job, device, grown, census.counts())
    return Profile(
        params=tuple(params),
        layers=lp,
        batch_size=batch_size,
        samples_per_batch=batch_size,
        workers=workers,
        is_sequential=is_declared_sequence(net),
        sequential_reason="",
        compute_s=0.0,
        forward_s=0.0,
        backward_s=0.0,
        forward_flops=0,
        backward_flops=0,
        update_s_per_byte=0.0,
        timing_batch_size=batch_size,
        device=device.type,
        memory=memory,
        evaluates=job.evaluate_fn is not None,
    )


def _alpha(p: torch.Tensor) -> float:
    """Fraction of ``p``'s rows its sparse gradient touches (1.0 without one)."""
    g = p.grad.coalesce() if p.grad is not None and p.grad.is_sparse else None
    return g.indices().unique().numel() / p.shape[0] if g is not None else 1.0
