"""The profile's memory measurements: what one worker's step holds, per layer and at its peak,
on the device the workers use; the terms of the memory model (strategies/plan/memory_model.py) that
are measured rather than counted.

:func:`memory_profile` fills the profile's memory fields: the bytes each layer's forward saves
for backward (``layer_saved_bytes``, through ``torch.autograd.graph.saved_tensors_hooks``, each
storage counted once, parameters left out), the peaks of forward and of a whole step
(``forward_peak_bytes``, ``step_peak_bytes``; CUDA: ``max_memory_allocated``, CPU: the resident
high-water mark after ``malloc_trim``, strategies/common/measured_memory.py, as the workers
measure themselves), what new input shapes keep (``growth_bytes``, with the shape census of
strategies/profile/shapes.py), what ``data()``, the first forward, ``model()`` and a first trace
add once (``data_bytes``, ``first_use_bytes``, ``model_extra_bytes``, ``trace_bytes``), the
optimizer's state and step per parameter byte (``optimizer_state_ratio``,
``optimizer_step_ratio``), whether the servers update only touched rows (``rows_suffice``), and
a process's fixed overhead (``process_bytes``, ``device_overhead_bytes``). What each term means
in a prediction: docs/strategies.md, "The terms of a predicted peak". All figures in bytes;
activation figures at ``batch_size`` samples (they scale with it).
"""

from __future__ import annotations

import torch
from torch import nn

from hpar.strategies.common.measured_memory import PeakMemory
from hpar.strategies.job.traced import first_trace_bytes
from hpar.strategies.profile.records import MemoryProfile

PROBE_NUMEL = 1 << 20  # optimizer state probe: 4 MiB of float32


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(storage address, storage bytes) of a tensor, (0, 0) for one without storage."""
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):
        return 0, 0


class SavedBytes:
    """Context manager counting bytes saved for backward per layer (module docstring)."""

    def __init__(self, model: nn.Module, layers: list[nn.Module]):
        self.layers = layers
        self.saved = [0] * len(layers)
        self.params = {_storage(p)[0] for p in model.parameters()}
        self.seen: set[int] = set()
        self.current: int | None = None
        self._handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        if isinstance(t, torch.Tensor):
            ptr, nbytes = _storage(t)
            if ptr and ptr not in self.params and ptr not in self.seen and self.layers:
                self.seen.add(ptr)
                self.saved[len(self.layers) - 1 if self.current is None else self.current] += nbytes
        return t

    def __enter__(self):
        for i, m in enumerate(self.layers):
            self._handles.append(m.register_forward_pre_hook(lambda mod, a, i=i: setattr(self, "current", i)))
            self._handles.append(m.register_forward_hook(lambda mod, a, o: setattr(self, "current", None)))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()


def step_memory(model: nn.Module, layers: list[nn.Module], forward, device: torch.device) -> dict:
    """Measure one step of ``model``: ``forward()`` runs forward and loss and returns the
    loss; backward runs here. Returns ``layer_saved_bytes``, ``forward_peak_bytes``,
    ``step_peak_bytes`` and ``step_grad_bytes`` (module docstring); gradients are left set."""
    model.zero_grad(set_to_none=True)
    mem = PeakMemory(device)
    mem.start()
    with SavedBytes(model, layers) as saved:
        loss = forward()
    fwd = mem.peak_bytes() or 0
    loss.backward()
    del loss
    step = mem.peak_bytes() or 0
    grads = 0
    for p in model.parameters():
        g = p.grad
        if g is not None:
            grads += (
                (g._values().numel() * g.element_size() + g._indices().numel() * 8)
                if g.is_sparse
                else g.numel() * g.element_size()
            )
    return {
        "layer_saved_bytes": tuple(saved.saved),
        "forward_peak_bytes": fwd,
        "step_peak_bytes": step,
        "step_grad_bytes": grads,
    }


class Growth:
    """Usage: ``g = Growth(model, device)`` after a step, then more steps, then ``g.bytes()``:
    the resident bytes the process kept beyond what it held at the start (module docstring);
    0 on CUDA (the allocator's caches are not the process's growth)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.cpu = model, device.type == "cpu"
        self.start = self._held() if self.cpu else 0

    def _held(self) -> int:
        from hpar.strategies.common.measured_memory import release_freed_memory, status_bytes

        self.model.zero_grad(set_to_none=True)
        release_freed_memory()
        return status_bytes("VmRSS") or 0

    def bytes(self) -> int:
        return max(0, self._held() - self.start) if self.cpu and self.start else 0


def data_bytes(on_dev, batch_size: int, workers: int) -> int:
    """Peak bytes of a fresh ``data()`` iterator of rank 0 drawing two batches on the device
    (``on_dev``: strategies/profile/device.OnDevice)."""
    mem = PeakMemory(on_dev.device)
    mem.start()
    batches = on_dev.batches(0, workers, batch_size)
    held = next(batches)
    held = next(batches)
    peak = mem.peak_bytes() or 0
    del held, batches
    return peak


def optimizer_ratios(build_optimizer, device: torch.device) -> tuple[float, float]:
    """(state bytes, step peak bytes) per parameter byte of ``build_optimizer(params)`` (the
    user's optimizer) on a float32 probe of PROBE_NUMEL elements on ``device``: its state after
    two steps (every tensor of it counted once) and the peak of a third step above what was held
    before it (module docstring)."""
    p = nn.Parameter(torch.zeros(PROBE_NUMEL, device=device))
    opt = build_optimizer([p])
    for _ in range(2):
        p.grad = torch.full_like(p, 1e-3)
        opt.step()
    seen, total = set(), 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and _storage(v)[0] not in seen:
                seen.add(_storage(v)[0])
                total += v.numel() * v.element_size()
    mem = PeakMemory(device)
    mem.start()
    opt.step()
    step = mem.peak_bytes() or 0
    return total / (PROBE_NUMEL * 4), step / (PROBE_NUMEL * 4)


def device_overhead_bytes(device: torch.device) -> int:
    """Device memory in use outside torch's caching allocator (the CUDA context, libraries'
    workspaces) on a CUDA ``device``; 0 on the CPU."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def memory_profile(
    step: dict,
    batch_size: int,
    data: int,
    ratios: tuple[float, float],
    job,
    device: torch.device,
    growth: tuple[int, int, int] = (0, 0, 0),
    shapes: tuple[int, ...] = (),
) -> MemoryProfile:
    """The MemoryProfile of a measured ``step`` (:func:`step_memory`) at ``batch_size`` of
    ``job`` (its ``loaded_rss`` and ``cold`` figures, strategies/job/contract.py); ``growth``: (bytes,
    steps, steps that met a new shape) of :class:`Growth`; ``shapes``: the counts of the job's
    census of forward shapes (strategies/profile/shapes.py)."""
    cold = job.cold if device.type == "cpu" else {}  # resident bytes: CPU workers only
    warm_forward = step["forward_peak_bytes"] * cold.get("batch_size", batch_size) / max(batch_size, 1)
    first_use = max(0, int(cold.get("forward_bytes", 0) - warm_forward))
    return MemoryProfile(
        batch_size=batch_size,
        data_bytes=max(data, cold.get("data_bytes", 0)),
        optimizer_state_ratio=ratios[0],
        optimizer_step_ratio=ratios[1],
        process_bytes=job.loaded_rss,
        device_overhead_bytes=device_overhead_bytes(device),
        first_use_bytes=first_use,
        model_extra_bytes=cold.get("model_bytes", 0),
        rows_suffice=rows_suffice(job),
        growth_bytes=growth[0],
        growth_steps=growth[1],
        growth_new_shapes=growth[2],
        trace_bytes=first_trace_bytes(),
        shape_counts=tuple(shapes),
        **step,
    )


def rows_suffice(job) -> bool:
    """Whether the servers' update of the user's optimizer touches only the pushed rows
    (``OptimizerSpec.touched_rows_suffice`` of its first param group on a probe); True where it
    cannot be built so (the servers then refuse it anyway)."""
    from hpar.strategies.job.optimizer_rules import spec_from_group

    try:
        opt = job.build_optimizer([nn.Parameter(torch.zeros(1))], lr=1e-3)
        return spec_from_group(opt, opt.param_groups[0]).touched_rows_suffice()
    except Exception:  # the user's optimizer() on a bare list, or a rule the servers lack
        return True
