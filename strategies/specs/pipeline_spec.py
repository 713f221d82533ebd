"""``pipeline``: balanced pipeline model parallelism (strategies/runtimes/pipeline/): K stages of equal
predicted cost, R replicas of them, hpar's schedules (GPipe, 1F1B; asynchronous 1F1B with
weight stashing, 2BW or SpecTrain's weight prediction: Chen et al., arXiv 1809.02839) and
torch.distributed.pipelining's as peers. Its checks of a run config live here."""

from __future__ import annotations

from hpar.strategies.specs.base import StrategySpec

SYNC_SCHEDULES = ("gpipe", "1f1b")  # hpar's synchronous schedules
TORCH_PREFIX = "torch-"  # torch.distributed.pipelining's schedules


def _torch_peer_problem(cfg) -> str | None:
    """What torch.distributed.pipelining's schedules (the peers) cannot run."""
    if cfg.replicas > 1:
        return (
            f"--pipeline-replicas {cfg.replicas} is not supported with --schedule {cfg.schedule} (torch's "
            "schedules run one pipeline); use hpar's own 1f1b or gpipe"
        )
    if cfg.clip_grad_norm or (cfg.eval and cfg.eval_every):
        flag = "--clip-grad-norm" if cfg.clip_grad_norm else "--eval-every"
        return f"{flag} is not supported with --schedule {cfg.schedule} (torch's pipelining peer); use hpar's own 1f1b or gpipe"
    if cfg.precision == "bf16" and cfg.schedule not in ("torch-gpipe", "torch-1f1b"):
        return f"--precision bf16 is not supported with --schedule {cfg.schedule}; use torch-gpipe, torch-1f1b or hpar's own 1f1b"
    if cfg.precision == "fp16":
        return (
            f"--precision fp16 is not supported with --schedule {cfg.schedule} (torch's pipelining peer has no "
            "gradient scaler across its stages); use --precision bf16 or hpar's own 1f1b"
        )
    if cfg.schedule == "torch-1f1b" and cfg.micro_batches < cfg.pipeline_stages:
        return (
            f"--micro-batches {cfg.micro_batches}: torch.distributed.pipelining's Schedule1F1B needs "
            f"at least one per stage ({cfg.pipeline_stages}); raise it or use --schedule torch-gpipe"
        )
    return None


def _check(cfg) -> str | None:
    """Why a pipeline cannot run ``cfg``: its micro-batches already accumulate within a step
    (``--accumulate``); an asynchronous pipeline cannot skip a step on every stage (fp16,
    strategies/runtimes/pipeline/stage_loop.py); 2BW's shape rule (strategies/plan/schedules.py);
    and what torch's pipelining peers lack (:func:`_torch_peer_problem`)."""
    if cfg.accumulate > 1:
        return (
            "--accumulate does not apply to --strategy pipeline: its micro-batches already accumulate "
            "within a step; raise --micro-batches and --batch-size instead"
        )
    if cfg.schedule.startswith(TORCH_PREFIX):
        return _torch_peer_problem(cfg)
    if cfg.precision == "fp16" and cfg.schedule not in SYNC_SCHEDULES:
        return (
            f"--precision fp16 is not supported with --schedule {cfg.schedule}: the stages of an asynchronous "
            "pipeline apply an update at different times, so a step with inf/NaN cannot be skipped on every "
            "stage; use --precision bf16 or --schedule 1f1b"
        )
    if cfg.schedule == "async-2bw":
        try:
            check_2bw(
                cfg.pipeline_stages,
                cfg.micro_batches,
                "--gpus" if cfg.replicas == 1 else "stages (--gpus / --pipeline-replicas)",
            )
        except ValueError as exc:
            return str(exc)
    return None


PIPELINE = StrategySpec(
    name="pipeline",
    summary="balanced pipeline: K stages x R replicas, 1F1B or weight-predicting asynchronous schedules",
    runtime="hpar.strategies.runtimes.pipeline.pipeline_runtime:train",
    estimate="hpar.strategies.plan.estimates:estimate_pipeline",
    worker_memory="hpar.strategies.plan.memory_model:pipeline_terms",
    simplicity=2,
    pipelined=True,
    needs_plan=True,
    check=_check,
)


def check_2bw(num_stages: int, num_micro: int, stages: str = "--gpus") -> None:
    """Raise ValueError unless M >= K-1: PipeDream-2BW's batch b needs the weights after
    batch b-2's update when its first forward runs, which 1F1B guarantees only then.
    ``stages`` names K in the message (``--gpus``, or the stages of a K x R plan)."""
    if num_micro < num_stages - 1:
        raise ValueError(
            f"--micro-batches {num_micro}: --schedule async-2bw needs at least {stages} - 1 = {num_stages - 1} "
            "micro-batches per batch (PipeDream-2BW's delay of one); raise --micro-batches"
        )
