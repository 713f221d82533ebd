"""The resolved configuration of one run: a small frozen dataclass, saved as ``config.json``
in the run directory and read back by every worker and server process."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Iterable

from hpar.strategies.job.compression import Compression
from hpar.strategies.specs.decision import Plan
from hpar.strategies.specs.registry import names, spec as strategy_spec, where

STRATEGIES = names()  # --strategy's choices besides auto (strategies/specs/registry.py)

# The divergence guard of asynchronous pipelines (--on-divergence; runtimes/pipeline/divergence.py).
ACTIONS = ("off", "stop", "sync")


@dataclass(frozen=True)
class GuardConfig:
    """``action``: off, stop or sync; ``factor``: trip when loss > factor * recent minimum
    (> 1); ``window``: how many recent steps the minimum covers."""

    action: str = "off"
    factor: float = 2.0
    window: int = 50

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"--on-divergence {self.action!r}: choose one of {', '.join(ACTIONS)}")
        if not self.factor > 1:
            raise ValueError(f"--divergence-factor must be above 1, got {self.factor}")
        if self.window < 1:
            raise ValueError(f"divergence window must be at least 1, got {self.window}")


# Pipeline schedules: hpar's own, plus torch.distributed.pipelining's as the peers.
SCHEDULES = (
    "gpipe",
    "1f1b",
    "async-stash",
    "async-predict",
    "async-2bw",
    "async",
    "torch-gpipe",
    "torch-1f1b",
    "torch-interleaved-1f1b",
    "torch-zbv",
)
# Numeric precision of forward and backward (master weights and optimizer state stay fp32).
PRECISIONS = ("fp32", "bf16", "fp16")
# hpar run --find-unused-parameters: DDP's find_unused_parameters from the profile, or forced (strategies/runtimes/dataparallel/ddp.py).
FIND_UNUSED_MODES = ("auto", "on", "off")


def check_loop_flags(
    precision: str | None = None,
    clip_grad_norm: float | None = None,
    accumulate: int | None = None,
    eval_every: int | None = None,
) -> None:
    """Raise ValueError naming the flag and its valid range for a training-loop value out of
    range; None is a value not given. RunConfig checks its own values here, and ``hpar run``
    the flags it was given before it loads the script or profiles anything."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if clip_grad_norm is not None and clip_grad_norm < 0:
        raise ValueError(f"--clip-grad-norm must not be negative (0 turns clipping off), got {clip_grad_norm}")
    if accumulate is not None and accumulate < 1:
        raise ValueError(f"--accumulate must be at least 1, got {accumulate}")
    if eval_every is not None and eval_every < 0:
        raise ValueError(f"--eval-every must not be negative (0: only before and after training), got {eval_every}")


def check_cache_flags(cache_rows: float | None, staleness: int | None) -> None:
    """Raise ValueError (one line naming the flag) for a hot-row cache value out of range, or
    ``--cache-rows`` without ``--staleness``: a cached row may be read up to s updates stale, an
    accuracy trade hpar makes only when asked (strategies/runtimes/hybrid/cache.py)."""
    if staleness is not None and staleness < 0:
        raise ValueError(f"--staleness must not be negative (0: every read fresh), got {staleness}")
    if cache_rows is not None and (cache_rows < 0 or (cache_rows > 1 and cache_rows != int(cache_rows))):
        raise ValueError(
            f"--cache-rows {cache_rows:g}: give rows per table (an integer, at least 1) or a fraction "
            "of each table's rows below 1"
        )
    if cache_rows and staleness is None:
        raise ValueError(
            "--cache-rows needs --staleness S: a cached row is read up to S updates stale, an accuracy "
            "trade hpar never makes unasked (--staleness 0 reads every row fresh)"
        )


@dataclass(frozen=True)
class RunConfig:
    """Everything a process of the run needs to know, besides its own rank.

    ``batch_size`` is per worker (per data-parallel replica), in samples. ``world_size`` is the
    number of workers (GPUs or CPU processes; for ``pipeline`` stages x ``replicas``); the
    parameter servers of ``hybrid``/``ps`` come on top of it (``servers``).
    """

    script: str
    strategy: str
    world_size: int
    steps: int
    batch_size: int
    lr: float
    seed: int
    run_dir: str
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL)
    log_every: int = 10
    servers: int = 0
    schedule: str = "1f1b"
    micro_batches: int = 4
    checkpoint_every: int = 0
    keep_checkpoints: int = 2  # the newest complete checkpoints kept on disk (0: all)
    resume: bool = False
    plan: Plan = field(default_factory=Plan)  # the planner's Plan (strategies/specs/decision.py), may be empty
    eval: bool = True
    precision: str = "fp32"  # autocast dtype of forward/backward: fp32 (off), bf16, fp16 (+ GradScaler)
    clip_grad_norm: float = 0.0  # clip the global norm of the averaged gradient to this (0: off)
    accumulate: int = 1  # micro-steps (batches per worker) per optimizer step
    eval_every: int = 0  # call evaluate() every N optimizer steps during training (0: only at the ends)
    on_divergence: str = "off"  # asynchronous pipelines: off, stop or sync (strategies/runtimes/pipeline/divergence.py)
    divergence_factor: float = 2.0
    replicas: int = 1  # pipeline x data parallelism: R replicas of K = world_size / R stages
    find_unused_parameters: bool = (
        False  # DDP's (allreduce, allreduce-sparse, hybrid): see strategies/runtimes/dataparallel/ddp.py
    )
    staleness: int | None = (
        None  # hybrid/ps: a hot-row cache on every worker reads rows up to s updates stale (None: off)
    )
    cache_rows: float = 0.0  # its rows per table (>= 1) or fraction of each table (< 1); 0: the default fraction
    allow_unequal_batches: bool = False  # first batches of different sizes train (strategies/job/first_batch.py)
    sync_batchnorm: bool = (
        False  # BatchNorm statistics over every worker's batch (strategies/runtimes/dataparallel/sync_batchnorm.py)
    )
    compress: Compression = field(
        default_factory=Compression
    )  # --compress: DDP's AllReduce (strategies/job/compression.py)

    def __post_init__(self):
        if not isinstance(self.plan, Plan):  # config.json, or a caller's dict: a plan's keys, any subset
            object.__setattr__(self, "plan", Plan.from_dict(self.plan or {}, source="config.json: plan"))
        object.__setattr__(self, "compress", Compression.of(self.compress))  # "fp16", or config.json's dict
        spec = strategy_spec(self.strategy)  # ValueError naming the choices for an unknown one
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        for name in ("world_size", "steps", "batch_size", "log_every", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: choose cpu or cuda")
        if self.servers < 0 or self.checkpoint_every < 0 or self.keep_checkpoints < 0:
            raise ValueError("--servers, --checkpoint-every and --keep-checkpoints must not be negative")
        check_loop_flags(
            precision=self.precision,
            clip_grad_norm=self.clip_grad_norm,
            accumulate=self.accumulate,
            eval_every=self.eval_every,
        )
        check_cache_flags(self.cache_rows or None, self.staleness)
        if self.replicas < 1 or self.world_size % self.replicas:
            raise ValueError(
                f"--pipeline-replicas {self.replicas}: a pipeline plan is K stages x R replicas = --gpus "
                f"{self.world_size}; choose a divisor of --gpus"
            )
        if self.replicas > 1 and not spec.pipelined:
            raise ValueError(f"--pipeline-replicas {self.replicas} applies to a pipeline strategy only; drop it")
        unsupported = not_supported(self) or spec.problem(self)
        if unsupported:
            raise ValueError(unsupported)
        if self.on_divergence != "off" or self.divergence_factor != 2.0:
            GuardConfig(self.on_divergence, self.divergence_factor)
            if not spec.pipelined or not self.schedule.startswith("async"):
                raise ValueError(
                    f"--on-divergence {self.on_divergence}: the guard watches asynchronous pipelines only "
                    "(--strategy pipeline --schedule async-*); drop it for this run"
                )

    @property
    def pipeline_stages(self) -> int:
        """K, the stages of a pipeline plan: ``world_size / replicas`` (strategies/runtimes/pipeline/replicas.py)."""
        return self.world_size // max(self.replicas, 1)

    @property
    def backend(self) -> str:
        """The workers' dense group's backend (strategies/common/groups.py); the default group is gloo."""
        return "nccl" if self.device == "cuda" else "gloo"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return cls(**json.loads(text))

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)


class ConfigChanged(ValueError):
    """config.json is not the file the launcher wrote (its SHA-256 differs)."""


def load_config(path: str, sha256: str | None) -> RunConfig:
    """The RunConfig in ``path`` (a run's config.json), checked against the SHA-256 the
    launcher passed in ``HPAR_CONFIG_SHA256`` (``sha256``; None: not checked, for processes
    started by hand). Raises :class:`ConfigChanged` naming the file when it differs: someone
    who can write the run directory changed what the workers would run."""
    with open(path, "rb") as f:
        data = f.read()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise ConfigChanged(
            f"{path}: changed after the launcher wrote it (SHA-256 differs); not running it: "
            "keep run directories writable by you only"
        )
    return RunConfig.from_json(data.decode())


def sync_batchnorm_problem(strategy: str) -> str | None:
    """Why ``--sync-batchnorm`` does not apply to ``strategy`` (one line naming the flag and the
    strategies it applies to), or None: it synchronises data-parallel replicas' BatchNorm
    (strategies/runtimes/dataparallel/sync_batchnorm.py); a pipeline's stages and ps's workers are not
    such replicas ("auto": the planner's choice is checked once made)."""
    if strategy == "auto" or strategy_spec(strategy).sync_batchnorm:
        return None
    return (
        f"--sync-batchnorm synchronises BatchNorm over data-parallel workers: it applies to --strategy "
        f"{', '.join(where(sync_batchnorm=True))}, not {strategy}; drop it or choose one of those"
    )


def not_supported(cfg: RunConfig) -> str | None:
    """Why this run cannot honour the loop flags it was given whatever its strategy (one line
    naming the flag and the way out), or None; each strategy's own refusals are its spec's
    (strategies/specs/). The hot-row cache (``--staleness``) caches the parameter servers'
    rows, and holds gradients back, which a skipped fp16 step could not take back
    (strategies/runtimes/hybrid/cache.py)."""
    if cfg.sync_batchnorm and sync_batchnorm_problem(cfg.strategy):
        return sync_batchnorm_problem(cfg.strategy)
    if staleness_problem(cfg.staleness, cfg.strategy):
        return staleness_problem(cfg.staleness, cfg.strategy)
    if compress_problem(cfg.compress, cfg.strategy, cfg.precision):
        return compress_problem(cfg.compress, cfg.strategy, cfg.precision)
    if cfg.staleness is not None and cfg.precision == "fp16":
        return (
            "--staleness with --precision fp16: the cache holds gradients back over several steps, which a step "
            "skipped for inf/NaN could not take back; use --precision bf16 or fp32"
        )
    return None


def staleness_problem(staleness: int | None, strategy: str) -> str | None:
    """Why ``--staleness`` cannot run with ``strategy`` (one line naming the flag and the way
    out), or None: the hot-row cache caches the parameter servers' rows, so it needs a strategy
    whose spec says ``servers`` (``auto`` then plans among those)."""
    if staleness is None or strategy == "auto" or strategy_spec(strategy).servers:
        return None
    return (
        f"--staleness caches rows of the tables the parameter servers serve: it applies to --strategy "
        f"{' or '.join(where(servers=True))}, not {strategy}; drop it"
    )


def compress_problem(c: Compression, strategy: str, precision: str | None) -> str | None:
    """Why ``--compress c`` cannot run with ``strategy`` and ``--precision precision`` (one
    line naming the flag and the way out), or None. It replaces the hook of DDP's AllReduce,
    which only the strategies whose spec says ``compress_hooks`` run; PowerSGD's error feedback
    would carry a step's inf/NaN of fp16 mixed precision (a step its GradScaler skips) into
    every later step."""
    if not c.on:
        return None
    spec = strategy_spec(strategy)
    if not spec.compress_hooks:
        what = (
            "averages its replicas' gradients with its own bucketed AllReduce, not DDP's"
            if spec.pipelined
            else "has no dense AllReduce through DDP"
        )
        return (
            f"--compress {c}: --strategy {strategy} {what}; it applies to "
            f"{', '.join(where(compress_hooks=True))}; drop it"
        )
    if c.kind == "powersgd" and precision == "fp16":
        return (
            f"--compress {c} with --precision fp16: PowerSGD's error feedback would keep the inf/NaN of a step "
            "the gradient scaler skips; use --precision bf16 or fp32, or --compress fp16"
        )
    return None


def find_unused(mode: str, unused: Iterable[str], ignored: Iterable[str] = ()) -> bool:
    """DDP's ``find_unused_parameters`` for ``--find-unused-parameters MODE``: True for ``on``,
    False for ``off``; for ``auto``, whether a parameter of ``unused`` (names that got no
    gradient in a profiled step) is one DDP holds (not in ``ignored``: hybrid's served tables).
    Raises ValueError naming the flag for another mode."""
    if mode not in FIND_UNUSED_MODES:
        raise ValueError(f"--find-unused-parameters {mode!r}: choose one of {', '.join(FIND_UNUSED_MODES)}")
    if mode != "auto":
        return mode == "on"
    return bool(set(unused) - set(ignored))
