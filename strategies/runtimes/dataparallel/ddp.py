"""How hpar wraps a model in PyTorch DDP (``allreduce``, ``allreduce-sparse`` and the dense
part of ``hybrid``): ``find_unused_parameters`` as the run decided it, and DDP's error for a
parameter that got no gradient turned into one line naming the flag.

``find_unused_parameters=True`` makes DDP walk the autograd graph from the outputs every step
to mark parameters that got no gradient as ready: an extra traversal per step (BENCHMARKS.md
12), and torch's warning once per worker when nothing was unused. It is needed only where a
step leaves a trainable parameter out of the graph (a branch some batches skip); without it
DDP then fails at the next forward with "Expected to have finished reduction in the prior
iteration". DDP, Accelerate and Lightning default to False; Lightning names its opt-in on
that error, as :func:`unused_error_named` does. ``hpar run --find-unused-parameters
auto|on|off`` (RunConfig.find_unused_parameters): ``auto`` turns it on only where a profiled
step left a parameter DDP holds without a gradient (strategies/profile/unused.py).
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable, Iterable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from hpar.strategies.job.forward import inner_module
from hpar.strategies.job.contract import JobError

REDUCTION_ERROR = "Expected to have finished reduction in the prior iteration"
FLAG = "--find-unused-parameters"


def wrap(
    model: torch.nn.Module, group, device: torch.device, find_unused_parameters: bool, ignore: Iterable[str] = ()
) -> DDP:
    """``model`` in DDP over ``group`` (one device per process: ``device`` on CUDA), the
    parameters named in ``ignore`` left out (hybrid's served tables). ``model`` is what the
    forward runs through (a ``torch.compile`` wrapper stays, so DDP's hooks run outside the
    compiled region); ``ignore`` names parameters as the user wrote them, in the module inside
    (``forward.inner_module``), and DDP gets them by its own names (``_orig_mod.`` first)."""
    wanted = set(ignore)
    ids = {id(p) for n, p in inner_module(model).named_parameters() if n in wanted}
    ignore = sorted(n for n, p in model.named_parameters() if id(p) in ids)
    if ignore:
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
    return DDP(
        model,
        process_group=group,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
    )


def reducer_names(ddp: DDP) -> list[str]:
    """The names of the parameters DDP reduces, in its reducer's order (the indices its
    errors give): trainable ones of ``named_modules`` order, tied ones once, ignored ones out
    (as DDP's ``_build_params_for_reducer`` lists them); named as the user wrote them (inside
    a ``torch.compile`` wrapper)."""
    user = {id(p): n for n, p in inner_module(ddp.module).named_parameters()}
    names, seen = [], set()
    for module_name, module in ddp.module.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or f"{module_name}.{param_name}" in ddp.parameters_to_ignore or id(p) in seen:
                continue
            seen.add(id(p))
            names.append(user.get(id(p), f"{module_name}.{param_name}" if module_name else param_name))
    return names


def unused_message(text: str, names: list[str]) -> str | None:
    """The one line for DDP's error ``text`` when it is the unused-parameter one (None
    otherwise), naming the parameters its "did not receive grad" indices point to in
    ``names`` (:func:`reducer_names`) and the flag that fixes it."""
    if REDUCTION_ERROR not in text:
        return None
    found = re.search(r"did not receive grad for rank (\d+): ([\d ]+)", text)
    which = ""
    if found:
        idx = [int(i) for i in found.group(2).split()]
        shown = [names[i] if i < len(names) else f"#{i}" for i in idx[:4]] + (["..."] if len(idx) > 4 else [])
        which = f" ({', '.join(shown)} on worker {found.group(1)})"
    return (
        f"DDP: a parameter got no gradient in a step{which} while find_unused_parameters is off (a branch "
        f"some batches skip, unseen in the profiled steps?); run with {FLAG} on"
    )


@contextlib.contextmanager
def unused_error_named(ddp: DDP, event: Callable[[dict], None] | None = None):
    """Around a DDP forward: DDP's unused-parameter RuntimeError becomes a JobError of one
    line (:func:`unused_message`), which the worker prints without a traceback and exits 2.
    ``event`` (the worker's report channel) hears it first as ``{"kind": "unused", "message":
    line}``: the launcher then restarts the run with find_unused_parameters on where the
    setting was hpar's own (launcher/run/runner.py), and keeps the peers' complaints out of
    sight."""
    try:
        yield
    except RuntimeError as exc:
        line = unused_message(str(exc), reducer_names(ddp))
        if line is None:
            raise
        if event is not None:
            event({"kind": "unused", "message": line})
        raise JobError(line) from None
