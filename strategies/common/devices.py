"""Device helpers every runtime shares: what hpar moves between the host and the worker's
device, and how, so that CUDA workers need no host synchronisation where none is due.

Who moves what (the contract: docs/contract.md, "Devices"): hpar moves each batch to the
worker's device (``context.move_to``); the model hpar hands to ``evaluate(model)`` is on the CPU in every strategy (:func:`model_to_cpu`); served embedding tables stay on the
parameter servers and on the host, never whole on a worker's device.
"""

from __future__ import annotations

import torch


def model_to_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` moved to the CPU (in place, as ``Module.to``), for ``evaluate``."""
    return model.to("cpu")


def cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` on the CPU (``evaluate`` during training; the original stays put)."""
    import copy

    return copy.deepcopy(model).to("cpu")


def rng_state(device: torch.device) -> dict:
    """This process's RNG states: the CPU generator's and, on a CUDA worker, its device's."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device: torch.device) -> None:
    """Restore :func:`rng_state`'s ``state`` (a bare CPU ByteTensor, as older checkpoints
    hold, is the CPU state alone)."""
    if isinstance(state, torch.Tensor):
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor to receive rows bound for ``device``: pinned (page-locked) when
    the device is CUDA, so that the copy to the device can be asynchronous."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; from pinned host memory the copy is non-blocking (ordered on the
    current stream, so the kernels that use it wait for it, the host does not)."""
    return t.to(device, non_blocking=t.is_pinned())


def copy_to_host(t: torch.Tensor):
    """``(host tensor, event)``: ``t`` itself and None when it is already on the CPU; for a
    CUDA tensor a pinned host buffer filled by a non-blocking copy, and the CUDA event recorded
    after it on the current stream (``event.query()`` says whether the copy is done,
    ``event.synchronize()`` waits for it). The host does not wait here, so this may run inside
    a backward hook; read the buffer only after the event completed."""
    if t.device.type != "cuda":
        return t, None
    return async_copy_to_host(t)


def async_copy_to_host(t: torch.Tensor):
    """:func:`copy_to_host` for a tensor bound for the host from ``cuda``: a pinned buffer,
    ``copy_(non_blocking=True)``, then a CUDA event recorded after the copy."""
    host = host_buffer(tuple(t.shape), t.dtype, torch.device("cuda"))
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class DeviceClock:
    """Time points on ``device``'s timeline: :meth:`mark` is the host clock on the CPU and a
    CUDA event recorded on the current stream on CUDA (the host clock would time kernel
    launches, not kernels); :meth:`between` gives the seconds between two marks (on CUDA it
    waits for the later event). :meth:`now` is the host clock after the device finished
    everything queued (synchronize, then read): for regions timed with a host clock."""

    def __init__(self, device: torch.device):
        import time

        self.cuda, self._clock = device.type == "cuda", time.perf_counter

    def mark(self):
        if not self.cuda:
            return self._clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def between(self, a, b) -> float:
        """Seconds from mark ``a`` to mark ``b``."""
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1000.0

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return self._clock()


class ComputeTimer:
    """Seconds of compute between :meth:`start` and :meth:`stop` calls: the host clock on the
    CPU; on CUDA, CUDA events on the current stream (the host clock would time kernel
    launches, not kernels), read once per step by :meth:`take` after the last event completed."""

    def __init__(self, device: torch.device):
        import time

        self._clock, self.cuda = time.perf_counter, device.type == "cuda"
        self.seconds, self.events, self._start = 0.0, [], None
        self._step_mark = DeviceClock(device).mark() if self.cuda else None  # start of the step (take_step)

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = self._clock()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self._start, end))
        else:
            self.seconds += self._clock() - self._start

    def take(self) -> float:
        """Seconds timed since the last call (waits for the last CUDA event); resets."""
        if self.events:
            self.events[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self.events) / 1000.0
            self.events = []
        out, self.seconds = self.seconds, 0.0
        return out

    def take_step(self, host_idle: float) -> tuple[float, float]:
        """``(compute, idle)`` seconds since the previous call (or since construction), and
        resets: compute as :meth:`take`; idle is ``host_idle`` (the host clock's waits for
        peers) on the CPU, and on CUDA the stream time of the step not spent computing: the
        span between this call's CUDA event and the previous one's, minus compute (receives
        are stream waits on CUDA, which the host clock does not see)."""
        compute = self.take()
        if not self.cuda:
            return compute, host_idle
        clock = DeviceClock(torch.device("cuda"))
        end = clock.mark()
        span, self._step_mark = clock.between(self._step_mark, end), end
        return compute, max(0.0, span - compute)
