"""``hpar run``'s settings that depend on the strategy it runs, decided (and said in one line)
before any process starts: DDP's ``find_unused_parameters``, a pipeline's default
micro-batches, and whether the user's optimizer can step the gradients the strategy makes
(refused in one line where it cannot)."""
from __future__ import annotations

from rich.console import Console

from hpar.strategies.dataparallel.ddp import DDP_STRATEGIES, find_unused
from hpar.strategies.hybrid.client import placement


def default_micro_batches(console: Console, plan: dict, batch_size: int, stages: int) -> int:
    """Micro-batches per batch when neither ``--micro-batches`` nor the script's HPAR gives
    them: the plan's (the planner's choice divides the batch it profiled), else 4, moved to
    the nearest divisor of ``batch_size`` of at least ``stages`` where there is one
    (``schedules.micro_batch_count``; said in one line when it moves)."""
    from hpar.strategies.pipeline.schedules import micro_batch_count
    want = plan.get("micro_batches") or 4
    if batch_size % want == 0:
        return want
    m = micro_batch_count(want, batch_size, min(want, stages))
    if plan.get("micro_batches"):
        console.print(f"hpar: the plan's {want} micro-batches do not divide --batch-size {batch_size}; using {m}",
                      markup=False)
    return m


def ddp_find_unused(console: Console, job, mode: str, strategy: str, plan: dict, model, batch_size: int,
                    gpus: int) -> bool:
    """DDP's ``find_unused_parameters`` for this run (strategies/dataparallel/ddp.py): ``on``/``off`` as
    given; ``auto``: whether a parameter DDP holds (hybrid's served tables left out) got no
    gradient in a profiled step, from the plan's ``unused_params`` where the planner profiled,
    else from a few forward/backward steps here on ``model`` (check_job's, built with seed 0;
    strategies/profile/unused.py); said in one line when on. False for a strategy without DDP
    (ps, pipeline)."""
    if strategy not in DDP_STRATEGIES:
        return False
    if mode != "auto":
        return find_unused(mode, ())
    unused = plan.get("unused_params")
    if unused is None:
        from hpar.strategies.profile.unused import unused_parameters
        unused = unused_parameters(job, batch_size, gpus, model=model)   # check_job's model, seed 0
    served = [n for n, where in placement(model, strategy, plan).items() if where == "ps"] if strategy == "hybrid" else []
    held = sorted(set(unused) - set(served))
    if held:
        console.print(f"hpar: DDP looks for unused parameters every step (find_unused_parameters): {', '.join(held[:4])}"
                      f"{', ...' if len(held) > 4 else ''} got no gradient in a profiled step", markup=False)
    return bool(held)


def check_optimizer(console: Console, job, model, strategy: str, plan: dict, servers: int, lr: float) -> None:
    """Refuse (ValueError, one line naming the fix) an optimizer the parameter servers of
    ``hybrid``/``ps`` cannot apply to the tables they would serve (strategies/hybrid/shard.py:
    SGD, Adagrad, Adam, AdamW); under ``allreduce-sparse`` say which tables' optimizer has no
    sparse kernel, so that their gathered rows are made dense before each step
    (strategies/dataparallel/sparse_grads.py)."""
    from hpar.launcher.run.runner import SERVER_STRATEGIES
    if strategy in SERVER_STRATEGIES:
        from hpar.strategies.hybrid.client import ps_tables
        try:
            ps_tables(model, job.build_optimizer(model.parameters(), lr), strategy, plan, max(servers, 1))
        except ValueError as exc:
            raise ValueError(f"{job.path}: --strategy {strategy}: {exc}") from None
    if strategy == "allreduce-sparse":
        from hpar.strategies.dataparallel.sparse_grads import dense_before_step
        from hpar.strategies.models.tying import embedding_tables
        opt = job.build_optimizer(model.parameters(), lr)
        named = dict(model.named_parameters(remove_duplicate=False))
        tables = [f"{n}.weight" if n else "weight" for n, _ in embedding_tables(model)]
        dense = [n for n, _ in dense_before_step(opt, [(n, named[n]) for n in tables])]
        if dense:
            console.print(f"hpar: {type(opt).__name__} takes no sparse gradients: {', '.join(dense[:3])}"
                          f"{', ...' if len(dense) > 3 else ''} exchanged sparse, made dense before each step",
                          markup=False)
