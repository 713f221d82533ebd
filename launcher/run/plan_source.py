"""Where ``hpar run``'s plan comes from (a ``--plan`` file written by ``hpar profile``, the
strategy's defaults, or the planner) and the checks a pipelined run's plan passes before any
process starts (stages, schedule, torch.distributed.pipelining's peers)."""

from __future__ import annotations

import json

from rich.console import Console

from hpar.launcher.run.flags import PlanFlags
from hpar.strategies.job.config import RunConfig
from hpar.strategies.job.tying import embedding_tables, shared_across_stages
from hpar.strategies.plan.pipeline_grid import describe_plan
from hpar.strategies.plan.placement import placement
from hpar.strategies.plan.stage_cuts import check_pipeline, check_schedule, sequential_layers, split_micro
from hpar.strategies.specs.base import ON_SERVERS
from hpar.strategies.specs.decision import Plan
from hpar.strategies.specs.registry import spec as strategy_spec


def read_plan(path: str) -> Plan:
    """A plan written by ``hpar profile --plan-out`` (or any subset of its keys, with
    ``strategy``); ValueError, one line naming the file, otherwise (an unknown key named)."""
    try:
        with open(path, encoding="utf-8") as f:
            plan = json.load(f)
    except OSError as exc:
        raise ValueError(
            f"{path}: cannot read the plan ({exc.strerror}); pass a file written by `hpar profile --plan-out`"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg}); write it with `hpar profile --plan-out`"
        ) from None
    if not isinstance(plan, dict) or "strategy" not in plan:
        raise ValueError(f"{path}: not an hpar plan (no 'strategy' key); write it with `hpar profile --plan-out`")
    return Plan.from_dict(plan, source=path)  # named as the file's other errors


def plan_for(
    console: Console,
    job,
    flags: PlanFlags,
    batch_size: int,
    hosts: str | None,
    gpus: int,
    precision: str | None = None,
    capacity=None,
    cache=None,
    forwards: int | None = None,
) -> tuple[str, Plan, object]:
    """(strategy, Plan, the planner's Profile or None) from ``--plan``, or from the planner for ``auto`` and for
    ``pipeline`` (which needs its balanced stages), on ``capacity``'s memory (``--force``: a
    forced strategy that does not fit is planned anyway); the data-parallel strategies named
    explicitly run with their defaults and no profiling (their memory: strategies/plan/fit.py).
    ``flags``: the plan's flags as resolved (launcher/run/flags.PlanFlags); ``cache``: the
    hot-row caches ``--staleness`` allows the planner to choose (hybrid/cache.CacheConfig, or None);
    ``forwards``: each worker's forward passes over the run (steps times accumulation)."""
    strategy, plan_file = flags.strategy, flags.plan_file
    if plan_file:
        plan = read_plan(plan_file)
        if strategy not in ("auto", plan.strategy):
            raise ValueError(
                f"--strategy {strategy} contradicts --plan {plan_file} (strategy {plan.strategy}); drop one"
            )
        console.print(f"hpar: strategy {plan.strategy} from {plan_file}", markup=False)
        return plan.strategy, plan, None
    if strategy != "auto" and not strategy_spec(strategy).needs_plan:
        return strategy, Plan(strategy=strategy), None
    from hpar.launcher.run.plan_run import plan_job

    plan, profile = plan_job(
        job, batch_size, hosts, gpus, flags, precision=precision, capacity=capacity, cache=cache, forwards=forwards
    )
    if strategy == "auto":
        console.print(f"hpar: --strategy auto chose {plan.reason}", markup=False)  # the reason starts with the name
    return plan.strategy, plan, profile


def check_pipelined_run(console: Console, job, cfg: RunConfig, model, traced_on, bs: int, gpus: int) -> None:
    """The checks a pipelined run passes before any process starts (ValueError naming the flag):
    an ``async-predict`` schedule's optimizer, the stages of ``cfg.plan`` on ``model`` (traced on
    ``traced_on``, the first batch, where the model is not a declared sequence), the schedule
    against parameters shared across stages, a torch.distributed.pipelining schedule's peer;
    then the pipeline plan is printed. ``bs``: samples per worker; ``gpus``: the world size."""
    if cfg.schedule == "async-predict":
        from hpar.strategies.job.optimizer_rules import check_predictable

        check_predictable(job.build_optimizer(model.parameters(), cfg.lr), f"{job.path}: optimizer()")
    example = None if traced_on is None else split_micro(traced_on, cfg.micro_batches)[0]
    ranges = check_pipeline(
        model, cfg.pipeline_stages, cfg.plan, cfg.micro_batches, bs, example
    )  # refuse a plan that cannot run, before any process
    check_schedule(shared_across_stages(sequential_layers(model, example), ranges), cfg.schedule)
    layers = None
    if cfg.schedule.startswith("torch-"):  # strategies/runtimes/pipeline/torch_peers.py (one pipeline: R = 1)
        if traced_on is not None:
            raise ValueError(
                f"--schedule {cfg.schedule}: torch.distributed.pipelining's schedules run here on "
                "an nn.Sequential or hpar_layers() only; this model is cut by tracing, which "
                "hpar's own schedules run (gpipe, 1f1b, async, async-stash, async-predict, async-2bw)"
            )
        from hpar.strategies.plan.stage_cuts import VIRTUAL_STAGES, check_peer

        check_peer(cfg.schedule, len(sequential_layers(model)), gpus, cfg.micro_batches, cfg.device)
        if VIRTUAL_STAGES[cfg.schedule] > 1:
            layers = f"{VIRTUAL_STAGES[cfg.schedule]} chunks per process balanced on parameter counts"
    console.print(describe_plan(cfg, layers), markup=False)


def plain_when_idle(console: Console, strategy: str, inner, plan: Plan, servers: int | None) -> tuple[str, object]:
    """``(strategy, its spec)`` as the run goes: a server strategy whose plan puts no parameter of
    ``inner`` (the user's model, unwrapped) on the servers, with ``--servers`` not given, and a
    sparse-gradient strategy on a model with no embedding table run as their plain strategy (the
    spec's ``plain``), each said in one line; otherwise ``strategy`` unchanged."""
    spec = strategy_spec(strategy)
    if spec.servers and spec.plain and ON_SERVERS not in placement(inner, strategy, plan).values() and servers is None:
        console.print(
            f"hpar: {strategy} would put no parameter on the servers (no trainable embedding table, or the plan "
            f"keeps them on AllReduce), so it runs as {spec.plain} (no parameter server to start)",
            markup=False,
        )
        strategy, spec = spec.plain, strategy_spec(spec.plain)
    if spec.sparse_gradients and spec.plain and not embedding_tables(inner):
        console.print(
            f"hpar: {strategy} has no embedding table to give sparse gradients, so it runs as "
            f"{spec.plain} (the same program)",
            markup=False,
        )
        strategy, spec = spec.plain, strategy_spec(spec.plain)
    return strategy, spec
