"""``hpar run --compress``: the flag checked before the script is loaded, and the setting the run
config carries decided (and said in one line where it changes) before any process starts. The
setting itself: strategies/job/compression.py; the workers' hooks:
strategies/runtimes/dataparallel/compress_hooks.py."""

from __future__ import annotations

from typing import Callable

from hpar.strategies.job.compression import Compression
from hpar.strategies.job.config import RunConfig, compress_problem
from hpar.strategies.specs.registry import spec as strategy_spec


def early(flag: str | None, strategy: str, precision: str | None) -> Compression | None:
    """``--compress`` parsed, or None when not given; ValueError (one line naming the flag)
    for a bad value, or for a strategy named on the command line that cannot compress
    (``auto`` is decided once the planner has chosen: :func:`decide`)."""
    if flag is None:
        return None
    c = Compression.parse(flag)
    if strategy != "auto":
        problem = compress_problem(c, strategy, precision)
        if problem:
            raise ValueError(problem)
    return c


def decide(
    say: Callable[[str], None], c: Compression | None, strategy: str, strategy_flag: str, device: str
) -> Compression:
    """The run's compression: off when not asked; off, said in one line, when ``--strategy
    auto`` chose a strategy without DDP's AllReduce (the other refusals are the run config's);
    ``bf16`` on gloo (``device`` cpu) becomes ``fp16``, said in one line, where this torch
    build's gloo cannot AllReduce bfloat16 (pytorch/pytorch#111131)."""
    if c is None or not c.on:
        return Compression()
    if strategy_flag == "auto" and not strategy_spec(strategy).compress_hooks:
        say(
            f"hpar: the planner chose {strategy}, which has no dense AllReduce through DDP, so --compress {c} "
            "does not apply; it runs uncompressed"
        )
        return Compression()
    if c.kind == "bf16" and device != "cuda":
        from hpar.strategies.common.groups import bf16_works

        if not bf16_works():
            say(
                "hpar: --compress bf16: this torch build's gloo cannot AllReduce bfloat16 "
                "(pytorch/pytorch#111131); compressing to fp16 instead"
            )
            return Compression("fp16")
    return c


def from_plan(say, c: Compression | None, plan) -> Compression | None:
    """The compression the plan chose, for a run of ``plan`` (the planner's or ``--plan``'s)
    under the user's ``--compress`` ``c``: ``c`` where the planner chose it (the plan's
    ``compress``) or never weighed it (no runnable ``"<strategy> --compress <c>"`` row: a forced
    strategy, a plan made without ``--compress``); off, said in one line via ``say``, where it
    weighed it and predicted the strategy faster uncompressed. None stays None (not asked), said
    in one line where the plan chose a compression (a ``--plan`` file of ``hpar profile
    --compress``): compression is an accuracy trade hpar makes only when this run asks."""
    if c is None and plan is not None and plan.compress:
        say(
            f"hpar: the plan was chosen with --compress {plan.compress}, which this run was not given; "
            f"it runs {plan.strategy} uncompressed (pass --compress {plan.compress} to compress)"
        )
    if c is None or not c.on or plan is None or plan.compress == str(c):
        return c
    row = next((x for x in plan.candidates if x.strategy == f"{plan.strategy} --compress {c}" and x.available), None)
    if row is None:
        return c
    say(
        f"hpar: the planner predicts {plan.strategy} faster uncompressed ({plan.samples_per_s:,.0f} samples/s) than "
        f"with --compress {c} ({row.samples_per_s:,.0f}); it runs uncompressed (--strategy {plan.strategy} "
        f"--compress {c} forces it)"
    )
    return Compression()


def on_resume(cfg: RunConfig, flag: str | None) -> None:
    """``--compress`` given with ``--resume``: refused in one line unless it is the run's own
    (PowerSGD's state and the numbers depend on it)."""
    if flag is not None and Compression.parse(flag) != cfg.compress:
        raise ValueError(
            f"--compress {flag}: {cfg.run_dir} was trained with --compress {cfg.compress}, which its "
            "resume keeps; drop the flag"
        )


__all__ = ["early", "decide", "from_plan", "on_resume"]
