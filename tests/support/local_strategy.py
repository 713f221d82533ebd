"""A toy strategy added from outside hpar, as a plugin would add one: ``local``, one worker
training the whole model in its own process (no process group traffic). The registry test
(tests/test_strategy_registry.py) copies this module beside a ``*.dist-info`` folder whose
``entry_points.txt`` names :data:`LOCAL` in the ``hpar.strategies`` group, puts both on
PYTHONPATH and runs the real ``hpar profile`` and ``hpar run --strategy local``.

It is one module plus one entry point: its spec (name, runtime, cost model, memory model),
its cost model (the profiled compute of one step; infeasible on more than one worker) and its
runtime (the optimizer step on each batch, as one process trains)."""

from __future__ import annotations

import torch

from hpar.strategies.plan.costmodel import Estimate
from hpar.strategies.specs.base import ON_ALLREDUCE, StrategySpec


def estimate_local(profile, cluster) -> Estimate:
    """One worker's step: the profiled data, forward, backward and update seconds; infeasible,
    with the reason, on more than one worker."""
    if cluster.workers != 1:
        return Estimate("local", 0.0, 0, 0.0, feasible=False, note="runs on one worker only (--gpus 1)")
    step = profile.data_s + profile.forward_s + profile.backward_s + profile.update_s_per_byte * profile.total_bytes
    return Estimate(
        "local",
        step,
        profile.samples_per_batch,
        0.0,
        {"compute": step},
        placement={p.name: ON_ALLREDUCE for p in profile.params},
    )


def train(ctx):
    """``cfg.steps`` optimizer steps on this worker's batches (``data(0, 1, batch_size)``):
    the whole model in this process; writes RUN_DIR/model like every runtime."""
    from hpar.strategies.job.context import StepMeter, batch_samples, move_to
    from hpar.strategies.job.forward import call_model
    from hpar.strategies.state import state as run_state

    cfg, job = ctx.cfg, ctx.job
    torch.manual_seed(cfg.seed)
    model = job.build_model().to(ctx.device)
    opt = job.build_optimizer(model.parameters(), cfg.lr)
    batches = job.batches(ctx.rank, ctx.world_size, cfg.batch_size)
    meter = None
    for step in range(cfg.steps):
        inputs, targets = next(batches)
        meter = meter or StepMeter(ctx, batch_samples(inputs))
        meter.start()
        opt.zero_grad(set_to_none=True)
        loss = job.compute_loss(call_model(model, move_to(inputs, ctx.device)), move_to(targets, ctx.device))
        loss.backward()
        opt.step()
        meter.end(float(loss))
    run_state.write_final(cfg.run_dir, run_state.model_entries(model))
    return meter.result(model)


LOCAL = StrategySpec(
    name="local",
    summary="one worker, the whole model, no communication (a test plugin)",
    runtime=f"{__name__}:train",
    estimate=f"{__name__}:estimate_local",
    worker_memory="hpar.strategies.plan.memory_model:allreduce_terms",
    simplicity=9,
)
