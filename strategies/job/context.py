"""What every training runtime gets and gives back, and the step meter they share.

A runtime (``strategies/runtimes/dataparallel/allreduce.py``, ``hybrid.py``, ``pipeline.py``) is a function
``train(ctx: WorkerContext) -> TrainResult`` called in every worker process after the default
process group is up. It reports progress through ``ctx.report`` (one dict per logging
interval, see :class:`StepMeter`) and returns the trained model on worker rank 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hpar.strategies.common import measured_memory as memory
from hpar.strategies.job.config import RunConfig
from hpar.strategies.job.contract import Job


@dataclass
class WorkerContext:
    """One worker process. ``rank``/``world_size`` count workers only (torchrun's RANK and
    WORLD_SIZE); ``pg_rank``/``pg_world_size`` are its place in the default process group,
    which also holds the parameter servers when the strategy has them (servers take the
    ranks after the workers). ``host_of`` gives the host index of every default-group rank
    (empty when unknown), so byte counts can tell the bytes that leave this host."""

    job: Job
    cfg: RunConfig
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    report: Callable[[dict], None]
    pg_rank: int = 0
    pg_world_size: int = 1
    start_step: int = 0  # > 0 when resuming from a checkpoint
    host_of: tuple[int, ...] = ()
    event: Callable[[dict], None] | None = None  # free-form notices to the launcher
    on_step: Callable[[int], None] | None = None  # called with the run's step count after each step
    report_eval: Callable[[dict], None] = lambda metrics: None  # evaluate() results during training

    def is_remote(self, peer: int) -> bool:
        """Whether default-group rank ``peer`` runs on another host than this worker."""
        return peer_is_remote(self.host_of, self.pg_rank, peer)


def peer_is_remote(host_of: tuple[int, ...], me: int, peer: int) -> bool:
    """Whether ranks ``me`` and ``peer`` of the default group run on different hosts
    (``host_of`` maps rank to host index; False when it is empty)."""
    return bool(host_of) and host_of[peer] != host_of[me]


DENSE = "_dense_allreduce"  # ByteMeter name of DDP's gradient exchange


def ring_successor_remote(ctx: "WorkerContext", group_ranks: list[int]) -> bool:
    """Whether this worker's successor in the ring of ``group_ranks`` (default-group ranks
    in group order; gloo's ring AllReduce and AllGather send to the next rank) is on another
    host, so that all its collective bytes leave this host."""
    me = group_ranks.index(ctx.pg_rank)
    return ctx.is_remote(group_ranks[(me + 1) % len(group_ranks)])


def ring_allreduce_bytes(nbytes: int, world_size: int) -> float:
    """Bytes one worker sends (and receives) in a ring AllReduce of ``nbytes``: 2(N-1)/N * B."""
    return 2.0 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


class ByteMeter:
    """Bytes sent and received by name (a parameter, a table, DDP's dense AllReduce) since
    the last :meth:`take`, and the bytes sent to processes on other hosts since the last
    :meth:`take_remote`. Every runtime and the parameter servers count with it."""

    def __init__(self):
        self.by_name: dict[str, list[float]] = {}
        self.remote = 0.0

    def add(self, name: str, sent: float = 0, recv: float = 0, remote: bool = False) -> None:
        entry = self.by_name.setdefault(name, [0.0, 0.0])
        entry[0] += sent
        entry[1] += recv
        if remote:
            self.remote += sent

    def take_remote(self) -> float:
        out, self.remote = self.remote, 0.0
        return out

    def take(self) -> dict[str, tuple[float, float]]:
        out = {k: (v[0], v[1]) for k, v in self.by_name.items()}
        self.by_name = {}
        return out


@dataclass
class TrainResult:
    """What a runtime hands back. ``model`` is the whole trained model on worker rank 0
    (None elsewhere, and under hybrid/ps, whose servers hold the tables: the runtime then
    evaluates the model itself, ``eval_last``; every runtime writes the trained model where it
    lives, strategies/state.write_final); losses are the mean training loss of the first and last step;
    ``bytes_per_step`` is {"sent": mean bytes, "recv": mean bytes} per worker per step for
    gradient/parameter/activation exchange; ``extra`` goes into summary.json as is."""

    model: torch.nn.Module | None
    loss_first: float
    loss_last: float
    samples_per_s: float
    step_times: list[float]
    bytes_per_step: dict
    extra: dict = field(default_factory=dict)
    eval_last: dict | None = None  # worker 0: evaluate() already run by the runtime (hybrid/ps: tables served)


def move_to(obj: Any, device: torch.device) -> Any:
    """Move a tensor, or a tuple/list/dict of tensors, to ``device`` (other values as is)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(move_to(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: move_to(v, device) for k, v in obj.items()}
    return obj


def batch_samples(inputs: Any) -> int:
    """Number of samples in a batch: the leading dimension of its first tensor."""
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0]) if inputs.dim() else 1
    if isinstance(inputs, (tuple, list)) and inputs:
        return batch_samples(inputs[0])
    if isinstance(inputs, dict) and inputs:
        return batch_samples(next(iter(inputs.values())))
    raise ValueError(f"cannot count samples in inputs of type {type(inputs).__name__}")


class StepMeter:
    """Times steps, keeps losses and byte counts, and reports every ``log_every`` steps.

    Each report is one dict: ``step`` (1-based, counted from the run's start), ``loss`` (mean
    over the interval), ``samples_per_s`` (this process, over the interval), ``step_s``
    (mean seconds per step), ``bytes_sent``/``bytes_recv`` (mean bytes per step over the
    interval), ``bytes_sent_remote`` (the part of ``bytes_sent`` addressed to processes on
    other hosts, when the runtime passes it), ``logged`` (the mean over the interval of the
    script's ``log()`` metrics, when it has that hook), ``peak_bytes`` (this process's peak
    memory so far above its baseline, strategies/common/measured_memory.py, when measured), plus ``extra``'s
    keys. The run's last step closes the process's memory window (``memory.freeze_process``). ``samples_per_step`` counts this process's samples
    (its data-parallel replica's, for a pipeline stage). Step times of the first ``warmup`` steps are excluded
    from :meth:`samples_per_s`.
    """

    def __init__(self, ctx: WorkerContext, samples_per_step: int, warmup: int = 2):
        self.ctx, self.samples_per_step, self.warmup = ctx, samples_per_step, warmup
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.sent: list[int] = []
        self.recv: list[int] = []
        self.remote: list[float] = []
        self.ends: list[float] = []  # perf_counter() at the end of each step
        self.logged: list[dict] = []
        self._t0 = time.perf_counter()
        self._first_start = None

    def start(self) -> None:
        self._t0 = time.perf_counter()
        if self._first_start is None:
            self._first_start = self._t0

    def end(
        self,
        loss: float,
        sent: int = 0,
        recv: int = 0,
        extra: dict | None = None,
        sent_remote: float | None = None,
        logged: dict | None = None,
    ) -> None:
        now = time.perf_counter()
        self.step_times.append(now - self._t0)
        self.ends.append(now)
        if self._first_start is None:
            self._first_start = self._t0
        if logged:
            self.logged.append(logged)
        self.losses.append(float(loss))
        self.sent.append(int(sent))
        self.recv.append(int(recv))
        if sent_remote is not None:
            self.remote.append(float(sent_remote))
        n = len(self.losses)
        memory.release_freed_memory_paced()  # freed heap blocks back to the system (at most 1% of the time)
        if self.ctx.on_step is not None:
            self.ctx.on_step(self.ctx.start_step + n)
        if self.ctx.start_step + n >= self.ctx.cfg.steps:  # training is over: what follows is not measured
            memory.freeze_process()
        if n == 1 and self.ctx.event is not None:  # the launcher compares the workers' batch sizes
            self.ctx.event({"kind": "batch", "samples": self.samples_per_step, "rank": self.ctx.rank})
        if self.ctx.start_step + n == 1 and self.ctx.event is not None:
            # the run's very first loss, kept by the launcher across restarts and resumes
            self.ctx.event({"kind": "first_loss", "loss": float(loss), "rank": self.ctx.rank})
        every = self.ctx.cfg.log_every
        if n % every == 0 or self.ctx.start_step + n == self.ctx.cfg.steps:
            k = n % every or every
            dt = sum(self.step_times[-k:])
            self.ctx.report(
                {
                    "step": self.ctx.start_step + n,
                    "loss": sum(self.losses[-k:]) / k,
                    "samples_per_s": self.samples_per_step * k / dt if dt > 0 else 0.0,
                    "step_s": dt / k,
                    "bytes_sent": sum(self.sent[-k:]) / k,
                    "bytes_recv": sum(self.recv[-k:]) / k,
                    **({"bytes_sent_remote": sum(self.remote[-k:]) / k} if self.remote else {}),
                    **({"logged": _mean_dicts(self.logged)} if self.logged else {}),
                    **_peak(),
                    **(extra or {}),
                }
            )
            self.logged = []
        self._t0 = time.perf_counter()

    def samples_per_s(self) -> float:
        """This process's samples/s over the measured window: samples of the steps after the
        first ``warmup`` ones divided by the wall-clock seconds from the end of the last
        warm-up step to the end of the last step (everything in between counts: data
        loading, waiting for peers, logging). With ``warmup`` or fewer steps the window
        starts at the first step."""
        if not self.ends:
            return 0.0
        w = self.warmup if len(self.ends) > self.warmup else 0
        t_from = self.ends[w - 1] if w else (self._first_start or self.ends[0] - self.step_times[0])
        span = self.ends[-1] - t_from
        return self.samples_per_step * (len(self.ends) - w) / span if span > 0 else 0.0

    def interval_losses(self) -> dict:
        """Mean loss of the first and of the last logging interval (as the progress lines
        average them) and the interval length: ``loss_first_mean``, ``loss_last_mean``,
        ``loss_mean_steps``. NaN losses (a pipeline stage without the loss) stay NaN."""
        n, every = len(self.losses), max(1, self.ctx.cfg.log_every)
        if not n:
            return {}
        k_first, k_last = min(every, n), (n % every or every) if n >= every else n
        return {
            "loss_first_mean": sum(self.losses[:k_first]) / k_first,
            "loss_last_mean": sum(self.losses[-k_last:]) / k_last,
            "loss_mean_steps": [k_first, k_last],
        }

    def bytes_per_step(self) -> dict:
        n = max(len(self.sent), 1)
        return {"sent": sum(self.sent) / n, "recv": sum(self.recv) / n}

    def result(self, model: torch.nn.Module | None, replicas: int = 1, extra: dict | None = None) -> TrainResult:
        """The runtime's TrainResult; ``replicas`` (data-parallel workers) turns this
        process's samples/s into the run's global samples/s."""
        return TrainResult(
            model=model,
            loss_first=self.losses[0] if self.losses else float("nan"),
            loss_last=self.losses[-1] if self.losses else float("nan"),
            samples_per_s=self.samples_per_s() * replicas,
            step_times=list(self.step_times),
            bytes_per_step=self.bytes_per_step(),
            extra={**self.interval_losses(), **(extra or {})},
        )


def _peak() -> dict:
    """``{"peak_bytes": ...}``: this process's peak memory so far (strategies/common/measured_memory.py), or {}."""
    mem = memory.process_peak()
    peak = mem.peak_bytes() if mem is not None else None
    return {"peak_bytes": peak} if peak is not None else {}


def _mean_dicts(dicts: list[dict]) -> dict:
    """Key-wise mean of dicts of floats (a key counts only where present)."""
    keys = {k for d in dicts for k in d}
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in sorted(keys)}
