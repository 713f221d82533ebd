"""What FSDP2 itself adds to a worker's training step, measured on one worker: the profile's
``fsdp_overhead_s``, which the cost model charges every ``fsdp`` step beside the bytes its
collectives move (strategies/plan/costmodel_fsdp.py).

``fully_shard`` runs hooks around every unit's forward and backward: it copies the unit's
shards into the buffer its AllGather fills and the gathered parameters out of it, makes
the unsharded parameters and then the gradient shards as DTensors, and frees the unsharded
copies after each use (Zhao et al., "PyTorch FSDP", VLDB 2023; torch's FSDP2 design notes).
That work costs the same whether the group has one rank or many, and none of it is a
collective's bytes, and a model charging only its collectives missed it several times over
(BENCHMARKS.md, "The cost model against measurement").

Method: the user's model built twice, one copy ``fully_shard``-ed as the ``fsdp`` strategy
does (strategies/runtimes/dataparallel/fsdp.shard) over a process group of this one process, the two
stepped in turn on the same batches with the user's optimizer and loss (warm-up steps
first); the overhead is the difference of their shortest step times (on a shared machine a
median of a few steps can even come out negative). Skipped (None) where the
model is over ``MAX_BYTES`` (two more copies of it would be made), where this process already
has a process group, or where FSDP cannot wrap the model.
"""

from __future__ import annotations

import copy
import datetime
import warnings

import torch
import torch.distributed as dist

MAX_BYTES = 512 << 20  # larger models are not copied twice more to measure this
SLOW_S = 0.5  # seconds of timed FSDP steps after which three are enough


def _stepper(job, model, cast, clock):
    """A function of (inputs, targets) that runs one training step of ``model`` and returns
    its seconds on ``clock``."""
    from hpar.strategies.job.forward import call_model
    from hpar.strategies.profile.update import probe_optimizer

    opt = probe_optimizer(job, list(model.parameters()))

    def step(inputs, targets) -> float:
        t0 = clock.mark()
        opt.zero_grad(set_to_none=True)
        with cast():
            loss = job.compute_loss(call_model(model, inputs), targets)
        loss.backward()
        opt.step()
        return clock.between(t0, clock.mark())

    return step


def fsdp_overhead_s(job, device: torch.device, cast, batches: list, model_bytes: int, warmup: int = 2) -> float | None:
    """Seconds FSDP2's own work adds to one training step of ``job``'s model on ``device``
    (module docstring): min(step of the fully_shard-ed copy) - min(step of the plain copy) over ``batches`` ([(inputs, targets)] already on the device; the first ``warmup``
    untimed), at least 0. None where it is not measured (module docstring)."""
    from hpar.strategies.common.devices import DeviceClock
    from hpar.strategies.job.forward import inner_module

    if model_bytes > MAX_BYTES or dist.is_initialized() or len(batches) <= warmup:
        return None
    try:
        from hpar.strategies.runtimes.dataparallel.fsdp import check_available, shard

        check_available()
    except (ImportError, ValueError):
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        clock = DeviceClock(device)
        # copies: model() may hand out one object every call, which the user keeps
        plain = copy.deepcopy(inner_module(job.build_model())).to(device).train()
        wrapped = copy.deepcopy(inner_module(job.build_model())).to(device).train()
        shard(wrapped, dist.group.WORLD, device, 1)
        steps = [_stepper(job, plain, cast, clock), _stepper(job, wrapped, cast, clock)]
        times: list[list[float]] = [[], []]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP's notes on the user's model are for when it runs
            for i, (inputs, targets) in enumerate(batches):
                for which in (0, 1):  # in turn, so a spell of other work on the cores spoils both alike
                    seconds = steps[which](inputs, targets)
                    if i >= warmup:
                        times[which].append(seconds)
                if i >= warmup + 2 and sum(times[1]) > SLOW_S:  # three timed steps of a slow model are enough
                    break
        # the least of each: a spell of other work on shared cores lengthens steps, never shortens them
        return max(0.0, min(times[1]) - min(times[0]))
    except Exception:  # FSDP cannot wrap or step this model (the fsdp strategy says why when it is run)
        return None
    finally:
        dist.destroy_process_group()
