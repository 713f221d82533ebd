"""What ``hpar bench`` runs: the bench strategies (``hpar run --strategy`` and ``--schedule``
of each name), the bench's settings (:class:`BenchConfig`), the ``--strategies`` list, and how
many steps each strategy's run takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from hpar.strategies.specs.registry import strategies

# strategies whose runs take the planner's plan: a pipeline's stages, the servers' placement
PLANNED = {s.name for s in strategies() if s.needs_plan or s.servers}
HPAR_SCHEDULES = ("gpipe", "1f1b", "async-stash", "async-predict", "async-2bw")  # benched as STRATEGY-SCHEDULE
TORCH_SCHEDULES = ("torch-gpipe", "torch-1f1b", "torch-interleaved-1f1b", "torch-zbv")  # benched by their name


def _bench_strategies() -> dict[str, tuple[str, str | None]]:
    """bench name -> (hpar run --strategy, --schedule or None): every registered strategy
    (strategies/specs/registry.py), a pipelined one once per schedule."""
    out: dict[str, tuple[str, str | None]] = {}
    for s in strategies():
        if not s.pipelined:
            out[s.name] = (s.name, None)
            continue
        out.update({f"{s.name}-{schedule}": (s.name, schedule) for schedule in HPAR_SCHEDULES})
        out.update({schedule: (s.name, schedule) for schedule in TORCH_SCHEDULES})
    return out


BENCH_STRATEGIES: dict[str, tuple[str, str | None]] = _bench_strategies()


@dataclass(frozen=True)
class BenchConfig:
    """What to bench. ``hosts`` is a host spec for ``hpar run --hosts`` (None: this machine);
    ``bandwidth_Bps``/``latency_s`` None: probe the loopback link for the cost model;
    ``project`` > 0 adds the cost model's projection to that many GPUs; ``precision`` (None:
    the script's) is every run's ``--precision`` and the profile's; ``threads`` (None: ``hpar
    run``'s default) every process's CPU threads; ``repeat`` runs of every strategy, in rounds
    (every strategy once per round, so that a slow spell of the machine hits all of them)."""

    scripts: tuple[str, ...]
    gpus: int
    strategies: tuple[str, ...]
    steps: int
    bench_dir: str
    batch_size: int | None = None
    seed: int = 0
    hosts: str | None = None
    ssh_key: str | None = None
    bandwidth_Bps: float | None = None
    latency_s: float | None = None
    project: int = 0
    device_tflops: float | None = None
    timeout_s: float = 600.0
    precision: str | None = None
    threads: int | None = None  # every process's CPU threads (--env OMP_NUM_THREADS); None: hpar run's default
    repeat: int = 1  # runs of every strategy, interleaved (round r runs every strategy once)
    min_seconds: float = 0.0  # more steps for a strategy predicted faster: see steps_for
    worker_memory_gb: float | None = None  # every run's --worker-memory (and the plans' capacity)
    server_memory_gb: float | None = None  # every run's --server-memory
    keep_models: bool = (
        False  # keep each run's trained model (RUN_DIR/model, hf/, checkpoints/); else removed once read
    )


MAX_STEPS = 5000  # steps_for's ceiling


def steps_for(cfg: BenchConfig, predicted_step_s: float | None) -> int:
    """Steps of one strategy's run: ``cfg.steps``, or more so that the steps after the 2
    warm-up ones take ``cfg.min_seconds`` at the predicted step time (at most MAX_STEPS): a
    model that steps in milliseconds is otherwise measured over a fraction of a second, in
    which one slow step (a log line, a heartbeat) moves samples/s by tens of percent."""
    if not cfg.min_seconds or not predicted_step_s:
        return cfg.steps
    return max(cfg.steps, min(MAX_STEPS, 2 + math.ceil(cfg.min_seconds / predicted_step_s)))


def _installed(name: str) -> bool:
    """Whether bench strategy ``name``'s runtime has what it needs here (its spec's
    ``check_available``: torchrec's optional install, FSDP2 in this torch)."""
    from hpar.strategies.specs.registry import spec

    s = spec(BENCH_STRATEGIES[name][0])
    try:
        if s.check_available:
            s.load("check_available")()
    except ValueError:
        return False
    return True


def parse_strategies(text: str | None) -> tuple[str, ...]:
    """``"hybrid,allreduce"`` -> names in BENCH_STRATEGIES (None or "all": every one whose
    library is installed, :func:`_installed`; a name given is run, or refused by its run, as
    asked). Raises ValueError naming ``--strategies`` and the valid names for an unknown one."""
    if not text or text.strip() == "all":
        return tuple(n for n in BENCH_STRATEGIES if _installed(n))
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [n for n in names if n not in BENCH_STRATEGIES]
    if bad or not names:
        raise ValueError(
            f"--strategies: unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(BENCH_STRATEGIES)}"
        )
    return names


COMPRESS_ROW = " --compress "  # a compressed row's name: "<bench name> --compress <setting>"


def bench_entry(name: str) -> tuple[str, str | None]:
    """(hpar run --strategy, --schedule or None) of bench row ``name``, a compressed row's
    ("hybrid --compress powersgd:2") that of its strategy."""
    return BENCH_STRATEGIES[name.split(COMPRESS_ROW, 1)[0]]


def row_compress(name: str) -> str | None:
    """The ``--compress`` setting of bench row ``name`` ("fp16", "powersgd:2"), None for an uncompressed row."""
    return name.split(COMPRESS_ROW, 1)[1] if COMPRESS_ROW in name else None


def row_dir(name: str) -> str:
    """Bench row ``name``'s run directory name, without spaces or colons (remote shells, host
    files): "hybrid --compress powersgd:2" -> "hybrid-compress-powersgd-r2"."""
    return name.replace(COMPRESS_ROW, "-compress-").replace(":", "-r")


def with_compress(names: tuple[str, ...], text: str | None) -> tuple[str, ...]:
    """``names`` with, after each whose strategy compresses DDP's AllReduce (spec
    ``compress_hooks``), one row per ``--compress`` setting in ``text`` ("fp16,powersgd:2"; ``off``
    adds nothing: the uncompressed row is always there). ValueError naming ``--compress`` for a
    bad setting, or when no strategy in ``names`` can compress."""
    from hpar.strategies.job.compression import Compression
    from hpar.strategies.specs.registry import spec

    if text is None:
        return names
    settings = [str(c) for c in dict.fromkeys(Compression.parse(t) for t in text.split(",") if t.strip()) if c.on]
    if not settings:
        return names
    able = [n for n in names if spec(BENCH_STRATEGIES[n][0]).compress_hooks]
    if not able:
        raise ValueError(
            f"--compress {text}: none of {', '.join(names)} averages gradients with DDP's AllReduce; "
            "add one that does to --strategies: "
            + ", ".join(n for n in BENCH_STRATEGIES if spec(BENCH_STRATEGIES[n][0]).compress_hooks)
        )
    return tuple(row for n in names for row in (n, *(f"{n}{COMPRESS_ROW}{c}" for c in settings if n in able)))


@dataclass(frozen=True)
class BenchFlags:
    """``hpar bench``'s flags as given (click's names; None: not given), passed whole to the
    single-cluster and the ``--scale`` benches: the workers and hosts (``emulate:H``), the
    emulated links (rate, queue, latency), the strategies and run length, the seed and
    precision, the outputs (JSON, plot, run directory), the projection (``project`` GPUs,
    ``device_tflops``, ``gpus_per_host``), SSH, the time limit per strategy (s), repeats, the
    memory each process may use (GB) and the memory table."""

    gpus: int = 2
    hosts: str | None = None
    link_rate: str | None = None
    link_queue: str = "fifo"
    latency: str | None = None
    strategies: str | None = None
    steps: int = 30
    batch_size: int | None = None
    seed: int = 0
    precision: str | None = None
    json_out: str | None = None
    plot_out: str | None = None
    project: int = 0
    device_tflops: float | None = None
    gpus_per_host: int | None = None
    bench_dir: str | None = None
    ssh_key: str | None = None
    timeout_s: float = 600.0
    repeat: int = 1
    min_seconds: float = 0.0
    worker_memory: float | None = None
    server_memory: float | None = None
    memory_table: bool = False
    scale: str | None = None
    keep_models: bool = False
    compress: str | None = None  # --compress: rows of the compressing strategies with these settings
