"""``hpar run``'s checks and message for a pipeline plan of K stages x R replicas
(``--pipeline-replicas R``, strategies/runtimes/pipeline/replicas.py), made before any process starts,
and the :class:`Grid`: which worker rank holds which stage of which replica."""

from __future__ import annotations

from dataclasses import dataclass

from hpar.strategies.specs.decision import Plan
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
        raise ValueError(
            f"--pipeline-replicas {replicas} applies to --strategy {' or '.join(pipelines)} only, not "
            f"{strategy}; drop one"
        )
    if replicas < 1 or gpus % replicas:
        raise ValueError(
            f"--pipeline-replicas {replicas}: a pipeline plan is K stages x R replicas = --gpus {gpus}; "
            f"choose a divisor of {gpus}"
        )
    from hpar.strategies.plan.stage_cuts import sequential_layers

    layers = len(sequential_layers(model, example))
    if gpus // replicas > layers:
        raise ValueError(
            f"--pipeline-replicas {replicas}: --gpus {gpus} / {replicas} = {gpus // replicas} stages, but the "
            f"model has only {layers} layers; raise --pipeline-replicas or lower --gpus"
        )
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
        raise ValueError(
            f"{source}: 'replicas' must be a positive integer, got {value!r}; write the plan with "
            "`hpar profile --plan-out`"
        )
    if flag is not None and flag != value:
        raise ValueError(f"--pipeline-replicas {flag} contradicts {source} ({value} replicas); drop one")
    return value


def describe_plan(cfg, layers: str | None = None) -> str:
    """The line ``hpar run`` prints for a pipeline run: stages x replicas, the rank layout,
    the layer ranges (or ``layers``), micro-batches and schedule."""

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


LAYOUTS = ("stages-adjacent", "replicas-adjacent")


@dataclass(frozen=True)
class Grid:
    """K ``stages`` x R ``replicas`` of a pipeline plan on K x R workers, placed by ``layout``
    (one of LAYOUTS, see the module docstring). Raises ValueError for counts below 1 or an
    unknown layout."""

    stages: int
    replicas: int = 1
    layout: str = "stages-adjacent"

    def __post_init__(self):
        if self.stages < 1 or self.replicas < 1:
            raise ValueError(
                f"a pipeline plan needs at least 1 stage and 1 replica, got {self.stages} x {self.replicas}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"pipeline layout {self.layout!r}: choose one of {', '.join(LAYOUTS)}")

    @classmethod
    def of(cls, cfg) -> "Grid":
        """The grid of a RunConfig: ``cfg.replicas`` replicas of ``cfg.pipeline_stages`` stages,
        the layout from ``cfg.plan`` (default ``stages-adjacent``)."""
        return cls(cfg.pipeline_stages, cfg.replicas, cfg.plan.layout or LAYOUTS[0])

    @property
    def size(self) -> int:
        return self.stages * self.replicas

    def rank_of(self, stage: int, replica: int) -> int:
        """The worker rank of ``stage`` (0..K-1) of ``replica`` (0..R-1)."""
        assert 0 <= stage < self.stages and 0 <= replica < self.replicas, (stage, replica)
        if self.layout == "stages-adjacent":
            return replica * self.stages + stage
        return stage * self.replicas + replica

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of worker ``rank``."""
        assert 0 <= rank < self.size, rank
        if self.layout == "stages-adjacent":
            return rank % self.stages, rank // self.stages
        return rank // self.replicas, rank % self.replicas

    def pipeline_ranks(self, replica: int) -> list[int]:
        """Worker ranks of stages 0..K-1 of ``replica`` (its point-to-point peers)."""
        return [self.rank_of(k, replica) for k in range(self.stages)]

    def stage_ranks(self, stage: int) -> list[int]:
        """Worker ranks of the R replicas of ``stage`` (its AllReduce group), replica order."""
        return [self.rank_of(stage, r) for r in range(self.replicas)]
