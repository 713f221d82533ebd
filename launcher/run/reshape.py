"""``hpar run --resume RUN_DIR``: the run's own config set to resume (:func:`resumed_config`), and
the resume with another size or plan (``--gpus``, ``--hosts``,
``--servers``, ``--strategy``, ``--plan``, ``--pipeline-replicas``, ``--batch-size``, ...).

The run is planned afresh for the new shape, as a new run of the same script would be, but
with the old run's own settings (its steps, learning rate, seed, batch size, precision,
clipping, ...: :func:`old_settings`) where no flag says otherwise, and it resumes from the
run's latest checkpoint: every process reads what it holds in the new shape from it
(torch.distributed.checkpoint reshards: strategies/state/state.py), tables re-partitioned over the
new servers, stages re-cut. The new shape's batches continue at the checkpoint's step. With
the same global batch (samples per optimizer step over all workers) the synchronous
strategies continue as an uninterrupted run of the new shape would from that state; a
changed global batch is said in one line (:func:`describe_reshape`).
"""

from __future__ import annotations

import os

from hpar.launcher.run.validate import finished, resume_step
from hpar.strategies.state import checkpoint
from hpar.strategies.state.trust import check_trusted
from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.strategies.job.config import RunConfig

KEPT = (
    "steps",
    "batch_size",
    "lr",
    "seed",
    "log_every",
    "checkpoint_every",
    "keep_checkpoints",
    "precision",
    "clip_grad_norm",
    "accumulate",
    "eval_every",
    "staleness",
    "cache_rows",
)


def old_settings(cfg: RunConfig) -> dict:
    """The settings of the run being resumed, as the defaults of its new shape (``HPAR``'s keys)."""
    return {key: getattr(cfg, key) for key in KEPT}


def global_batch(cfg: RunConfig) -> int:
    """Samples per optimizer step over all workers: each data-parallel worker's (a pipeline
    replica's) batch, times the replicas, times ``--accumulate``."""
    width = cfg.replicas if strategy_spec(cfg.strategy).pipelined else cfg.world_size
    return cfg.batch_size * width * cfg.accumulate


def shape(cfg: RunConfig) -> str:
    """A run's shape in words: ``4 workers (allreduce)``, ``2 workers, 2 servers (hybrid)``,
    ``4 stages x 1 replica (pipeline)``."""
    if strategy_spec(cfg.strategy).pipelined:
        return f"{cfg.world_size // cfg.replicas} stages x {cfg.replicas} replica{'s' if cfg.replicas > 1 else ''} ({cfg.strategy})"
    servers = f", {cfg.servers} server{'s' if cfg.servers != 1 else ''}" if cfg.servers else ""
    return f"{cfg.world_size} worker{'s' if cfg.world_size != 1 else ''}{servers} ({cfg.strategy})"


def describe_reshape(old: RunConfig, new: RunConfig) -> str:
    """The line ``hpar run`` prints for a resume at another shape."""
    line = f"resuming {shape(old)} as {shape(new)}"
    a, b = global_batch(old), global_batch(new)
    if a == b:
        return line + f"; the global batch stays {a} samples"
    return (
        line + f"; the global batch changes from {a} to {b} samples per step, so the run does not continue as "
        "the old shape would (--batch-size sets each worker's)"
    )


__all__ = ["old_settings", "global_batch", "describe_reshape", "shape"]


class NothingToDo(Exception):
    """``--resume`` of a run that already finished the steps asked for; ``str()`` is the line
    to print (the run's own figures, from its summary.json), and nothing starts (exit 0)."""


def resumed_config(resume_dir: str, script: str | None, steps: int | None, say=print) -> RunConfig:
    """The config of the run in ``resume_dir``, set to resume from its last complete checkpoint
    (checked before anything starts: launcher/run/validate.py). Raises NothingToDo when that
    run finished at ``steps`` (default: its own) or beyond."""
    path = os.path.join(resume_dir, "config.json")
    check_trusted(resume_dir, "--resume")  # its config names the code every worker runs
    if not os.path.exists(path):
        raise ValueError(
            f"--resume {resume_dir}: no config.json there; pass the run directory of an earlier `hpar run`"
        )
    cfg = RunConfig.from_json(open(path, encoding="utf-8").read())
    if script and os.path.abspath(script) != cfg.script:
        raise ValueError(f"--resume {resume_dir}: that run trained {cfg.script}, not {os.path.abspath(script)}")
    summary = finished(resume_dir, steps or cfg.steps)
    if summary is not None:
        from hpar.launcher.run.progress import final_line

        checkpoint.remove_temp_files(resume_dir)  # as every start does: what a killed write left
        raise NothingToDo(
            final_line(
                summary, os.path.abspath(resume_dir), f"nothing to do: the run finished at step {summary['steps']}"
            )
        )
    step = resume_step(resume_dir, say)
    if step is None:
        raise ValueError(
            f"--resume {resume_dir}: no checkpoint there; start runs with --checkpoint-every N to resume them"
        )
    say(f"hpar: resuming {os.path.abspath(resume_dir)} from its checkpoint of step {step}")
    return cfg.replace(resume=True, steps=steps or cfg.steps, run_dir=os.path.abspath(resume_dir))
