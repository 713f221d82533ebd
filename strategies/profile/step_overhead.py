"""The host's own seconds in a worker's training step on an accelerator: the profile's
``step_overhead_s``, which the cost model charges every strategy's step beside the device's
timed work (strategies/plan/costmodel.py, ``CostSetting.host``).

Why: the profile times a GPU's forward and backward with CUDA events, the optimizer on a probe
and the data draw apart, and the model added them up, which predicted lm.py's step on one GPU
well under what was measured (BENCHMARKS.md, "On one GPU: H100 and H200"). Between
the timed regions the host runs Python while the device waits: the loss's ``.item()`` that
every hpar worker reads each micro-step (strategies/common/loop.micro_steps), which stops the host from
queueing the next step's kernels ahead; ``zero_grad``; the optimizer's own loop over the tensors
beyond the probe's; the autocast context; moving the batch.

Method: a copy of the model stepped as a worker steps it (batch drawn from the job's stream
and moved to the device, forward and loss under the workers' autocast, backward, ``.item()``,
the user's optimizer, ``zero_grad``), each step timed whole on the host clock with the device
synchronized at both ends, warm-up steps first; the overhead is the shortest step less what the
model already charges for its parts (``charged_s``: data draw, forward, backward and update as
profiled), at least 0.

Measured on accelerators only (None on a CPU): there the profile's timings are the host's own
wall clock, so a step has no gap between them for the host to fill, and the difference would be
timing noise. None too for models over ``MAX_BYTES`` (another copy and its optimizer state
would be made on the device) and where the copy does not fit the device's memory.
"""

from __future__ import annotations

import copy

import torch

MAX_BYTES = 512 << 20  # larger models are not copied once more to measure this
SLOW_S = 1.0  # seconds of timed steps after which three are enough


def whole_step_s(job, model, device: torch.device, cast, batches, steps: int = 6, warmup: int = 2) -> float | None:
    """The shortest wall seconds of one training step of ``model`` (already on ``device``) as a
    worker runs it (module docstring), over ``steps`` timed steps after ``warmup`` untimed ones,
    each drawing its batch from ``batches`` (an iterator of host batches: (inputs, targets)).
    The least, since a spell of other work on the host lengthens steps and never shortens them;
    None when the batches run out before a step is timed."""
    from hpar.strategies.job.context import move_to
    from hpar.strategies.common.devices import DeviceClock
    from hpar.strategies.job.forward import call_model
    from hpar.strategies.profile.update import probe_optimizer

    clock, opt, times = DeviceClock(device), probe_optimizer(job, list(model.parameters())), []
    for i in range(warmup + steps):
        t0 = clock.now()
        try:
            inputs, targets = next(batches)
        except StopIteration:
            break
        inputs, targets = move_to(inputs, device), move_to(targets, device)
        with cast():
            loss = job.compute_loss(call_model(model, inputs), targets)
        loss.backward()
        loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(clock.now() - t0)
            if len(times) >= 3 and sum(times) > SLOW_S:
                break
    return min(times) if times else None


def step_overhead_s(
    job, device: torch.device, cast, batch_size: int, workers: int, charged_s: float, model_bytes: int = 0
) -> float | None:
    """Seconds a worker's step of ``batch_size`` samples on ``device`` takes beyond ``charged_s``
    (the seconds the cost model charges for that step's data draw, forward, backward and update,
    as profiled): the host's own per-step time, at least 0 (module docstring). None where it is
    not measured: on a CPU, for a model of over ``MAX_BYTES`` (``model_bytes``), or when the copy
    runs out of device memory. Exceptions from the user's functions propagate (the profiler
    reports them as the user's)."""
    if device.type == "cpu" or model_bytes > MAX_BYTES:
        return None
    from hpar.strategies.job.forward import inner_module

    try:
        model = copy.deepcopy(inner_module(job.build_model())).to(device).train()
        seconds = whole_step_s(job, model, device, cast, job.batches(0, workers, batch_size))
    except torch.OutOfMemoryError:
        return None
    finally:
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return None if seconds is None else max(0.0, seconds - charged_s)
