"""``hpar run``'s settings that depend on the strategy it runs, decided (and said in one line)
before any process starts: DDP's ``find_unused_parameters``, a pipeline's default
micro-batches, and whether the user's optimizer can step the gradients the strategy makes
(refused in one line where it cannot)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from hpar.strategies.specs.registry import spec as strategy_spec
from hpar.strategies.specs.base import ON_SERVERS
from hpar.strategies.job.config import find_unused
from hpar.strategies.plan.placement import placement
from hpar.strategies.specs.decision import Plan


def default_micro_batches(say: Callable[[str], None], plan: Plan, batch_size: int, stages: int, model=None) -> int:
    """Micro-batches per batch when neither ``--micro-batches`` nor the script's HPAR gives
    them: the plan's (the planner's choice divides the batch it profiled), else 4, moved to
    the nearest divisor of ``batch_size`` of at least ``stages`` where there is one
    (``schedules.micro_batch_count``; said in one line when it moves); for a ``model`` with
    BatchNorm, at most ``batch_size / 2`` (2 samples each: strategies/plan/stage_cuts.py)."""
    from hpar.strategies.plan.schedules import micro_batch_count
    from hpar.strategies.plan.stage_cuts import batchnorm_names

    want = plan.micro_batches or 4
    if model is not None and batch_size >= 2 and batch_size // want < 2 and batchnorm_names(model):
        fewer = max(d for d in range(1, batch_size // 2 + 1) if batch_size % d == 0)
        say(
            f"hpar: {fewer} micro-batches instead of {want}: BatchNorm needs at least 2 samples in each "
            f"of a --batch-size {batch_size}"
        )
        return fewer
    if batch_size % want == 0:
        return want
    m = micro_batch_count(want, batch_size, min(want, stages))
    if plan.micro_batches:
        say(f"hpar: the plan's {want} micro-batches do not divide --batch-size {batch_size}; using {m}")
    return m


def ddp_find_unused(
    say: Callable[[str], None], job, mode: str, strategy: str, plan: Plan, model, batch_size: int, gpus: int
) -> bool:
    """DDP's ``find_unused_parameters`` for this run (strategies/runtimes/dataparallel/ddp.py): ``on``/``off`` as
    given; ``auto``: whether a parameter DDP holds (hybrid's served tables left out) got no
    gradient in a profiled step, from the plan's ``unused_params`` where the planner profiled,
    else from a few forward/backward steps here on ``model`` (check_job's, built with seed 0;
    strategies/profile/unused.py); said in one line when on. False for a strategy without DDP
    (ps, pipeline)."""
    if not strategy_spec(strategy).ddp:
        return False
    if mode != "auto":
        return find_unused(mode, ())
    unused = plan.unused_params
    if unused is None:
        from hpar.strategies.profile.unused import unused_parameters

        unused = unused_parameters(job, batch_size, gpus, model=model)  # check_job's model, seed 0
    served = (
        [n for n, where in placement(model, strategy, plan).items() if where == ON_SERVERS]
        if strategy_spec(strategy).servers
        else []
    )
    held = sorted(set(unused) - set(served))
    if held:
        say(
            f"hpar: DDP looks for unused parameters every step (find_unused_parameters): {', '.join(held[:4])}"
            f"{', ...' if len(held) > 4 else ''} got no gradient in a profiled step"
        )
    return bool(held)


def check_unused_by_rank(job, strategy: str, plan: Plan, model, batch_size: int, gpus: int) -> None:
    """Refuse (ValueError, one line) a strategy that cannot train a model whose ranks' batches
    leave different parameters without a gradient in one step (``spec.unused_by_rank``
    False: FSDP2, strategies/plan/costmodel_fsdp.py), when a few steps on several ranks'
    batches here (strategies/profile/unused.py, on ``model``: check_job's, seed 0) show it.
    The planner leaves such a strategy out itself; a named one is checked here."""
    if strategy_spec(strategy).unused_by_rank or gpus < 2 or plan.unused_params is not None:
        return  # a plan from a profile: the planner left the strategy out where it saw them
    from hpar.strategies.plan.costmodel_fsdp import UNUSED_BY_RANK
    from hpar.strategies.profile.unused import probe_unused

    if probe_unused(job, batch_size, gpus, model=model).by_rank:
        raise ValueError(f"{job.path}: --strategy {strategy}: {UNUSED_BY_RANK}")


def check_optimizer(say: Callable[[str], None], job, model, strategy: str, plan: Plan, lr: float) -> None:
    """Refuse (ValueError, one line naming the fix) an optimizer the parameter servers of
    ``hybrid``/``ps`` cannot apply to the tables they would serve (strategies/runtimes/hybrid/shard.py:
    SGD, Adagrad, Adam, AdamW); under ``allreduce-sparse`` say which tables' optimizer has no
    sparse kernel, so that their gathered rows are made dense before each step
    (strategies/job/optimizer_rules.py)."""
    if strategy_spec(strategy).servers:
        from hpar.strategies.plan.placement import served_rules

        try:
            served_rules(model, job.build_optimizer(model.parameters(), lr), strategy, plan)
        except ValueError as exc:
            raise ValueError(f"{job.path}: --strategy {strategy}: {exc}") from None
    if strategy_spec(strategy).sparse_gradients:
        from hpar.strategies.job.optimizer_rules import dense_before_step
        from hpar.strategies.job.tying import embedding_tables

        opt = job.build_optimizer(model.parameters(), lr)
        named = dict(model.named_parameters(remove_duplicate=False))
        tables = [f"{n}.weight" if n else "weight" for n, _ in embedding_tables(model)]
        dense = [n for n, _ in dense_before_step(opt, [(n, named[n]) for n in tables])]
        if dense:
            say(
                f"hpar: {type(opt).__name__} takes no sparse gradients: {', '.join(dense[:3])}"
                f"{', ...' if len(dense) > 3 else ''} exchanged sparse, made dense before each step"
            )


def cache_settings(
    say: Callable[[str], None],
    job,
    model,
    strategy: str,
    asked: str,
    plan: Plan,
    staleness: int | None,
    cache_rows: float | None,
    batch_size: int,
    gpus: int,
) -> tuple[int | None, float, Plan]:
    """``(staleness, cache_rows, plan)`` of the run's hot-row caches (strategies/runtimes/hybrid/cache.py):
    the flags', else those of a plan file made with ``--staleness`` (``plan.cache``), else
    none. ``asked`` is the ``--strategy`` given: under ``auto`` the cache runs only where the
    planner chose it, and a plan without it drops the flag, saying so in one line. A plan for
    the caches gets their first rows: the plan's, else the hottest of the rows counted here over
    the job's batches (strategies/profile/hot_rows.py), with the predicted hit rate; one line says
    what runs."""
    given = dict(plan.cache or {})
    if staleness is None and given:
        staleness, cache_rows = given["staleness"], cache_rows if cache_rows is not None else given.get("rows", 0.0)
    if staleness is None:
        return None, 0.0, plan
    if not strategy_spec(strategy).servers or (asked == "auto" and not given):
        say(
            f"hpar: --staleness {staleness}: the plan runs {strategy} without hot-row caches (predicted at "
            "least as fast), so the flag is dropped"
        )
        return None, 0.0, plan
    from hpar.strategies.specs.servers_spec import CacheConfig

    cache = CacheConfig(float(cache_rows or 0.0), staleness)
    if not given.get("hot_rows"):
        from hpar.strategies.plan.placement import placement
        from hpar.strategies.plan.costmodel_cache import plan_cache
        from hpar.strategies.profile.hot_rows import row_counts
        from hpar.strategies.job.tying import embedding_tables

        served = {n for n, where in placement(model, strategy, plan).items() if where == ON_SERVERS}
        embs = [(n, m) for n, m in embedding_tables(model) if (f"{n}.weight" if n else "weight") in served]
        hot = row_counts(job, model, embs, batch_size, gpus)
        params = dict(model.named_parameters())
        given = plan_cache(hot, {n: int(params[n].shape[0]) for n in hot}, cache, gpus, served)
    plan = dataclasses.replace(plan, cache={**given, "staleness": staleness, "rows": cache.rows})
    rows = f"{cache.rows:g} rows" if cache.rows >= 1 else f"{(cache.rows or 0.1):.0%} of the rows"
    say(
        f"hpar: hot-row caches: {rows} of each served table on every worker, reads up to {staleness} "
        f"update(s) stale; predicted hit rate {plan.cache.get('predicted_hit_rate', 0):.0%}"
    )
    return staleness, cache.rows, plan
