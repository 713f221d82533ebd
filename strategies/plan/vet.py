"""The refusals ``hpar run`` makes once a plan is chosen, asked of every runnable candidate
before the planner chooses: ``--strategy auto`` never picks a strategy that ``hpar run`` then
refuses, and ``hpar profile`` never lists one as runnable (issue 67).

The profile decides most of what can run (memory, the optimizer rule the servers can apply,
a pipeline's split); what it cannot see is checked here on the model itself, with the same
functions ``hpar run`` calls before start: a strategy's own ``check_model`` (torchrec: a table
to shard, an optimizer TorchRec can fuse, no ``scheduler()``), and for parameter servers: the
parameters a parameter server would serve must each be in a param group of the user's
``optimizer()`` with a rule the servers can run
(strategies/plan/strategy_settings.check_optimizer), and a ``torch.compile(fullgraph=True)``
model cannot serve a table (strategies/runtimes/hybrid/embedding.check_fullgraph). A candidate that
fails is listed as not runnable, its note the refusal's line, and the planner chooses again
without it.
"""

from __future__ import annotations

from types import SimpleNamespace

from hpar.strategies.plan.costmodel_compress import is_compressed_row
from hpar.strategies.specs.decision import Plan
from hpar.strategies.specs.registry import spec as strategy_spec

CHECK_LR = 1e-3  # the optimizer's learning rate in the checks (no rule the servers refuse depends on it)


def refusal(job, model, strategy: str, plan: Plan) -> str:
    """Why ``hpar run`` would refuse ``strategy`` under ``plan`` for ``model`` (as ``model()``
    returned it) before anything starts, as one line without the script's name; "" when it
    would not: the spec's ``check_model`` (torchrec), and the parameter servers' checks."""
    spec = strategy_spec(strategy)
    if spec.check_model and not spec.servers:  # torchrec: its tables and the optimizer it can fuse
        from hpar.strategies.job.forward import inner_module

        try:
            spec.load("check_model")(job, inner_module(model), CHECK_LR)
        except ValueError as exc:
            why = str(exc)
            return why[len(f"{job.path}: ") :] if why.startswith(f"{job.path}: ") else why
        return ""
    if not spec.servers:
        return ""
    from hpar.strategies.plan.strategy_settings import check_optimizer
    from hpar.strategies.plan.placement import placement
    from hpar.strategies.plan.placement import check_fullgraph
    from hpar.strategies.job.forward import inner_module

    inner = inner_module(model)
    try:
        check_fullgraph(model, placement(inner, strategy, plan))
        check_optimizer(lambda _: None, job, inner, strategy, plan, CHECK_LR)
    except ValueError as exc:
        why = str(exc)
        prefix = f"{job.path}: --strategy {strategy}: "
        return why[len(prefix) :] if why.startswith(prefix) else why
    return ""


def lacking(strategy: str, needs: tuple) -> str:
    """The flag ``strategy`` cannot honour among ``needs`` (StrategySpec capability names, as
    ``--sync-batchnorm`` needs ``sync_batchnorm``), as one line; "" when it has them all."""
    spec = strategy_spec(strategy)
    missing = [n for n in needs if not getattr(spec, n)]
    return f"--{missing[0].replace('_', '-')} does not apply to {strategy}" if missing else ""


def unsettled(strategy: str, settings: tuple, schedule: str | None = None) -> str:
    """The run setting ``strategy`` cannot honour (its spec's ``check``, as RunConfig asks it
    before start: torchrec with ``--precision bf16``, ``--clip-grad-norm``, ``--accumulate``),
    as one line; "" when it can. ``settings``: the run's ``(key, value)`` pairs of precision,
    clip_grad_norm and accumulate (flags, else the script's HPAR); the others at their defaults."""
    spec = strategy_spec(strategy)
    if not settings or spec.check is None:
        return ""
    cfg = SimpleNamespace(
        **{
            "strategy": strategy,
            "schedule": schedule or "1f1b",
            "precision": "fp32",
            "clip_grad_norm": 0.0,
            "accumulate": 1,
            **dict(settings),
        }
    )
    try:
        return spec.problem(cfg) or ""
    except AttributeError:  # a check reading a setting the planner is not given: `hpar run` asks it later
        return ""


def vetted_plan(job, profile, cluster, model=None, needs: tuple = (), settings: tuple = (), **choose) -> Plan:
    """``choose_plan(profile, cluster, **choose)`` (strategies/plan/planner.py) where no
    runnable candidate is one :func:`refusal` refuses: each runnable candidate's own plan
    (``force``) is checked on ``model`` (built with ``job.build_model()`` when None and a
    candidate needs it), and when any is refused the planner chooses again with those marked
    not runnable (``refused``); so is one whose spec's ``check`` refuses the run's ``settings``
    (:func:`unsettled`). A forced strategy (``choose["force"]``) is returned as
    planned: ``hpar run`` refuses it itself, in its own words. ``needs``: capabilities every
    candidate must have (:func:`lacking`; ``--sync-batchnorm``), the others not runnable.
    Raises ValueError as ``choose_plan`` does (no strategy left that fits)."""
    from hpar.strategies.plan.planner import choose_plan

    if choose.get("force") is not None:
        return choose_plan(profile, cluster, **choose)
    plan = choose_plan(profile, cluster, **choose)
    own = [c for c in plan.candidates if not is_compressed_row(c.strategy)]  # compressed rows: vetted as their strategy
    why_not = {
        c.strategy: lacking(c.strategy, needs) or unsettled(c.strategy, settings, choose.get("schedule"))
        for c in own
        if (needs or settings) and c.available
    }
    refused = {name: why for name, why in why_not.items() if why}
    if refused:
        plan = choose_plan(profile, cluster, refused=refused, **choose)
    for c in own:
        spec = strategy_spec(c.strategy)
        if not c.available or not (spec.servers or spec.check_model):
            continue
        try:
            its = (
                plan
                if c.strategy == plan.strategy or not spec.servers
                else choose_plan(profile, cluster, **{**choose, "force": c.strategy})
            )  # its own placement
        except ValueError:
            continue  # its own plan does not fit: choose_plan says so in its note
        if model is None:
            model = job.build_model()
        why = refusal(job, model, c.strategy, its)
        if why:
            refused[c.strategy] = why
    return choose_plan(profile, cluster, refused=refused, **choose) if refused else plan
