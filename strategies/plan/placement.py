"""Which parameter goes where under ``hybrid`` and ``ps`` (Parallax, Kim et al., EuroSys 2019:
row-sparse embedding tables on the parameter servers, the dense rest on AllReduce), decided
before any process starts and read again by the runtime (strategies/runtimes/hybrid/client.py)
so that the two agree: the plan's placement, the default one, frozen parameters kept on the
workers, each served parameter's optimizer rule, and the refusals that follow.
"""

from __future__ import annotations

import torch

from hpar.strategies.job.forward import inner_module
from hpar.strategies.job.optimizer_rules import OptimizerSpec, spec_from_group
from hpar.strategies.job.tying import dense_shared_embeddings, embedding_tables
from hpar.strategies.specs.base import ON_ALLREDUCE, ON_SERVERS
from hpar.strategies.specs.decision import Plan
from hpar.strategies.specs.registry import spec as strategy_spec


def embedding_weights(model: torch.nn.Module) -> set[str]:
    """Names of the row-sparse embedding weights of ``model`` (``tying.embedding_tables``:
    every nn.Embedding / nn.EmbeddingBag weight except one tied to a dense user)."""
    return {f"{n}.weight" if n else "weight" for n, _ in embedding_tables(model)}


def placement(model: torch.nn.Module, strategy: str, plan: Plan) -> dict[str, str]:
    """``{param name: "ps" | "allreduce"}``: ``plan.placement`` when given, else every
    embedding weight on the PS for ``hybrid`` and everything for ``ps``. A frozen parameter
    (``requires_grad=False``: no gradient, no update) is never served: it stays on the workers
    with the dense part ("allreduce", though no gradient of it is exchanged), whatever the plan
    says. Raises ValueError for a plan naming unknown parameters or places."""
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    return {n: (ON_ALLREDUCE if n in frozen else where) for n, where in _placement(model, strategy, plan).items()}


def _placement(model: torch.nn.Module, strategy: str, plan: Plan) -> dict[str, str]:
    """:func:`placement` before frozen parameters are kept on the workers."""
    names = [n for n, _ in model.named_parameters()]
    given = plan.placement
    if not strategy_spec(strategy).ddp:  # ps: nothing on AllReduce
        return {n: ON_SERVERS for n in names}
    if given:
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValueError(
                f"plan placement names unknown parameters {unknown[:3]}; re-run `hpar profile` for this script"
            )
        bad = sorted({v for v in given.values()} - {ON_SERVERS, ON_ALLREDUCE})
        if bad:
            raise ValueError(f"plan placement has {bad}; each parameter goes to {ON_SERVERS!r} or {ON_ALLREDUCE!r}")
        tied = dense_shared_embeddings(model)
        served = sorted(n for n in tied if given.get(n) == ON_SERVERS)
        if served:
            raise ValueError(
                f"plan places {served[0]} on the servers, but it is tied to a dense user "
                f"({', '.join(tied[served[0]])}); keep it on allreduce (re-run `hpar profile`)"
            )
        return {n: given.get(n, ON_ALLREDUCE) for n in names}
    emb = embedding_weights(model)
    return {n: (ON_SERVERS if n in emb else ON_ALLREDUCE) for n in names}


def check_fullgraph(model: torch.nn.Module, place: dict[str, str]) -> None:
    """Raise ValueError (one line, for the launcher to print before anything starts) when
    ``model``, as ``model()`` returned it, was compiled with ``torch.compile(...,
    fullgraph=True)`` and ``place`` (:func:`placement` of the module inside) serves an
    embedding table from the parameter servers: its lookup is a graph break (see the module
    docstring), which dynamo refuses under ``fullgraph`` ("Skip calling
    torch.compiler.disable()d function") in every worker."""
    wrapper, fullgraph = model, False
    while isinstance(wrapper, torch.nn.Module):
        fullgraph = fullgraph or bool(getattr(getattr(wrapper, "dynamo_ctx", None), "fullgraph", False))
        wrapper = getattr(wrapper, "_orig_mod", None)
    served = sorted(n for n in embedding_weights(inner_module(model)) if place.get(n) == ON_SERVERS)
    if fullgraph and served:
        raise ValueError(
            f"model() is compiled with fullgraph=True, but the parameter servers serve {served[0]}, whose "
            "rows are pulled in a graph break inside the forward; compile without fullgraph=True (the "
            "rest of the forward stays compiled) or use --strategy allreduce or allreduce-sparse"
        )


def served_rules(
    model: torch.nn.Module, opt: torch.optim.Optimizer, strategy: str, plan: Plan
) -> list[tuple[str, torch.nn.Parameter, OptimizerSpec]]:
    """``(name, parameter, the servers' update rule)`` of each parameter :func:`placement`
    puts on the servers, in ``named_parameters`` order. ``opt`` is the user's optimizer over
    the model's trainable parameters; each served parameter takes its param group's rule
    (``plan.sparse_optimizer``: exact or lazy). Raises ValueError (one line with the fix) for
    a served parameter in no param group, or a rule the servers cannot apply."""
    place = placement(model, strategy, plan)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    out = []
    for name, p in model.named_parameters():
        if place[name] != ON_SERVERS:
            continue
        if id(p) not in group_of:
            raise ValueError(
                f"optimizer(): trainable parameter {name} is in no param group; pass it to the optimizer, "
                "or freeze it (requires_grad=False) to keep it fixed"
            )
        out.append((name, p, spec_from_group(opt, group_of[id(p)], plan.sparse_optimizer)))
    return out
