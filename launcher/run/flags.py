"""The flags of ``hpar run`` as a small tree of typed values, passed down whole instead of
forty keyword arguments: what to train (:class:`JobFlags`), how to plan it
(:class:`PlanFlags`), where (:class:`HostFlags`) and how the run is kept alive and written
(:class:`RunFlags`). ``None`` means "not given": the script's ``HPAR``, else the fallback,
decides (launcher/commands/run.resolve). ``Flags.of(**flat)`` builds the tree from the CLI's
flat names, and ``flags.but(**flat)`` replaces some of them wherever they live (the ``--tune``
trials: another strategy, plan file, run directory and length).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class JobFlags:
    """What to train: the script, its length and batch, the training loop's flags
    (``loop``: precision, clip_grad_norm, accumulate, eval_every; None where not given)."""

    script: str | None = None
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    seed: int | None = None
    log_every: int | None = None
    loop_flags: dict = field(default_factory=dict)
    no_eval: bool = False
    find_unused_parameters: str | None = None  # auto, on, off
    allow_unequal_batches: bool | None = None
    sync_batchnorm: bool | None = (
        None  # BatchNorm over every worker's batch (strategies/runtimes/dataparallel/sync_batchnorm.py)
    )


@dataclass(frozen=True)
class PlanFlags:
    """How to run it: the strategy (``auto``: the planner's), a plan file, servers, a
    pipeline's schedule, micro-batches and replicas, the workers' device, the memory each
    process may use (GB), ``force`` to run a plan predicted not to fit, and the hot-row caches
    of ``hybrid``/``ps`` (``--staleness``, ``--cache-rows``); ``--compress`` of DDP's AllReduce."""

    strategy: str = "auto"
    plan_file: str | None = None
    servers: int | None = None
    schedule: str | None = None
    micro_batches: int | None = None
    pipeline_replicas: int | None = None
    device: str = "auto"
    worker_memory: float | None = None
    server_memory: float | None = None
    force: bool = False
    staleness: int | None = None  # hybrid/ps: hot-row caches read rows up to this many updates stale
    cache_rows: float | None = None  # their rows per table (>= 1) or fraction of each table (< 1)
    compress: str | None = None  # --compress: off, fp16, bf16, powersgd[:RANK] (strategies/job/compression.py)
    needs: tuple = ()  # capabilities (StrategySpec flags) auto's choice must have, e.g. ("sync_batchnorm",)
    settings: tuple = ()  # (key, value) of precision, clip_grad_norm, accumulate: auto's choice must honour them


@dataclass(frozen=True)
class HostFlags:
    """Where: the number of workers, the hosts (a file or ``a:2,b:2``; None: this machine or
    the Slurm allocation), SSH settings, the interpreter on the hosts, ``--sync`` and ``--env``."""

    gpus: int | None = None
    hosts: str | None = None
    ssh_key: str | None = None
    ssh_port: int | None = None
    ssh_user: str | None = None
    ssh_local: bool = False
    ssh_known_hosts: str | None = None
    ssh_accept_new: bool = False
    python_path: str | None = None
    sync: bool = False
    env: tuple = ()


@dataclass(frozen=True)
class RunFlags:
    """How the run is written and kept alive: its directory, checkpoints, ``--resume``,
    restarts, the stall and phase deadlines (seconds), the divergence guard, plain output."""

    run_dir: str | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int | None = None
    resume_dir: str | None = None
    max_restarts: int = 0
    stall_timeout: float = 0.0
    phase_timeout: float | None = None
    on_divergence: str = "off"
    divergence_factor: float = 2.0
    plain: bool = False
    group_readable: bool = False


_AT_LEAST_1 = ("gpus", "steps", "batch_size", "log_every", "micro_batches", "pipeline_replicas", "tune_steps")
_NOT_NEGATIVE = (
    "checkpoint_every",
    "keep_checkpoints",
    "max_restarts",
    "stall_timeout",
    "phase_timeout",
    "servers",
    "min_hosts",
)


def check_ranges(**given) -> None:
    """ValueError (one line naming the flag) for a count or duration out of its range: what
    ``hpar run`` can refuse at once, before it imports torch or loads the script (None: not
    given). The same limits are checked again where the values are used."""
    for name in _AT_LEAST_1:
        if given.get(name) is not None and given[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {given[name]}")
    for name in _NOT_NEGATIVE:
        if given.get(name) is not None and given[name] < 0:
            raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {given[name]}")
    if given.get("lr") is not None and given["lr"] <= 0:
        raise ValueError(f"--lr must be positive, got {given['lr']}")


GROUPS = {"job": JobFlags, "plan": PlanFlags, "hosts": HostFlags, "run": RunFlags}


@dataclass(frozen=True)
class Flags:
    """Every ``hpar run`` flag, in four groups."""

    job: JobFlags = field(default_factory=JobFlags)
    plan: PlanFlags = field(default_factory=PlanFlags)
    hosts: HostFlags = field(default_factory=HostFlags)
    run: RunFlags = field(default_factory=RunFlags)

    @classmethod
    def of(cls, **flat) -> "Flags":
        """The tree from flat flag names (``script=..., gpus=..., strategy=...``); a name no
        group has raises TypeError, as a wrong keyword argument would."""
        return cls().but(**flat)

    def but(self, **flat) -> "Flags":
        """A copy with the named flags replaced, wherever each lives."""
        groups = {name: {} for name in GROUPS}
        for key, value in flat.items():
            owner = next((g for g, kind in GROUPS.items() if key in {f.name for f in dataclasses.fields(kind)}), None)
            if owner is None:
                raise TypeError(f"unknown hpar run flag {key!r}")
            groups[owner][key] = value
        return Flags(**{g: dataclasses.replace(getattr(self, g), **groups[g]) for g in GROUPS})

    def flat(self) -> dict:
        """Every flag by its flat name."""
        return {
            f.name: getattr(getattr(self, g), f.name) for g, kind in GROUPS.items() for f in dataclasses.fields(kind)
        }


__all__ = ["Flags", "JobFlags", "PlanFlags", "HostFlags", "RunFlags", "check_ranges"]
