"""``hpar run``'s checks and message for a pipeline plan of K stages x R replicas
(``--pipeline-replicas R``, strategies/runtimes/pipeline/replicas.py), made before any process starts."""
from __future__ import annotations

from hpar.strategies.plan.decision import Plan
from hpar.strategies.specs.registry import where


def check_replicas_flag(replicas: int | None, gpus: int, strategy: str, model, example=None) -> str:
    """The strategy to plan for, after checking ``--pipeline-replicas`` (None: not given):
    R must divide ``--gpus`` and leave K = gpus / R stages of at least one layer each
    (``example``: inputs to trace a model that is not a declared sequence on);
    ``--strategy auto`` with the flag means ``pipeline``. Raises ValueError (one line, the
    flag and the fix) otherwise."""
    if replicas is None:
        return strategy
    pipelines = where(pipelined=True)
    if strategy != "auto" and strategy not in pipelines:
        raise ValueError(f"--pipeline-replicas {replicas} applies to --strategy {' or '.join(pipelines)} only, not "
                         f"{strategy}; drop one")
    if replicas < 1 or gpus % replicas:
        raise ValueError(f"--pipeline-replicas {replicas}: a pipeline plan is K stages x R replicas = --gpus {gpus}; "
                         f"choose a divisor of {gpus}")
    from hpar.strategies.runtimes.pipeline.stage import sequential_layers
    layers = len(sequential_layers(model, example))
    if gpus // replicas > layers:
        raise ValueError(f"--pipeline-replicas {replicas}: --gpus {gpus} / {replicas} = {gpus // replicas} stages, but the "
                         f"model has only {layers} layers; raise --pipeline-replicas or lower --gpus")
    return strategy if strategy != "auto" else pipelines[0]


def planner_replicas(flag: int | None, schedule: str | None) -> int | None:
    """The R the planner must keep: the flag's, or 1 for torch.distributed.pipelining's
    schedules (they run one pipeline), else None (the planner chooses)."""
    if flag is None and (schedule or "").startswith("torch-"):
        return 1
    return flag


def plan_replicas(plan: Plan, flag: int | None, source: str) -> int:
    """R of a pipeline plan: ``plan.replicas`` (1 when not planned); ValueError naming ``source``
    when ``--pipeline-replicas`` says otherwise (a plan file made for another split)."""
    value = plan.replicas or 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{source}: 'replicas' must be a positive integer, got {value!r}; write the plan with "
                         "`hpar profile --plan-out`")
    if flag is not None and flag != value:
        raise ValueError(f"--pipeline-replicas {flag} contradicts {source} ({value} replicas); drop one")
    return value


def describe_plan(cfg, layers: str | None = None) -> str:
    """The line ``hpar run`` prints for a pipeline run: stages x replicas, the rank layout,
    the layer ranges (or ``layers``), micro-batches and schedule."""
    from hpar.strategies.runtimes.pipeline.replicas import Grid
    grid = Grid.of(cfg)
    stages = cfg.plan.stages or []
    layers = layers or ", ".join(f"[{a}, {b})" for a, b in stages) or "balanced on parameter counts"
    if grid.replicas == 1:
        shape = f"{grid.stages} stages"
    else:
        rank = "r*K + k" if grid.layout == "stages-adjacent" else "k*R + r"
        shape = f"{grid.stages} stages x {grid.replicas} replicas (rank = {rank}, {grid.layout})"
    micro = f"{cfg.micro_batches} micro-batch{'es' if cfg.micro_batches != 1 else ''}"
    per = " per replica" if grid.replicas > 1 else ""
    return f"hpar: pipeline plan: {shape}, layers {layers}, {micro}{per}, schedule {cfg.schedule}"
