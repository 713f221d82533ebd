"""The strategy registry: every strategy ``hpar run --strategy`` accepts, and what it is.

A :class:`StrategySpec` says what a strategy needs (parameter servers, DDP, stages, a plan
from the planner), how simple it is (near-ties in predicted speed go to the simpler one,
strategies/plan/planner.py), which run-config values it cannot honour (``check``), and where
its cost model, memory model and runtime live (``module:function`` strings, loaded on first
use with :meth:`StrategySpec.load`). Code outside this package asks a spec for a property
(``spec(cfg.strategy).servers``) instead of comparing strategy names.

Adding a strategy: one module that defines its spec, and one line in :data:`BUILT_IN` (or,
from outside hpar, an entry point in the ``hpar.strategies`` group naming the spec, as
``importlib.metadata`` reads them: Python packaging's entry-points specification).
"""

from __future__ import annotations

from typing import Any

from hpar.strategies.specs.allreduce_spec import ALLREDUCE, ALLREDUCE_SPARSE
from hpar.strategies.specs.base import StrategySpec
from hpar.strategies.specs.fsdp_spec import FSDP
from hpar.strategies.specs.pipeline_spec import PIPELINE
from hpar.strategies.specs.servers_spec import HYBRID, HYBRID_CACHE, PS
from hpar.strategies.specs.torchrec_spec import TORCHREC, TORCHREC_CW, TORCHREC_RW, TORCHREC_TW

ENTRY_POINT_GROUP = "hpar.strategies"
# The built-in strategies: --strategy's choices and the planner's candidates, in this order.
BUILT_IN: tuple[StrategySpec, ...] = (
    ALLREDUCE,
    ALLREDUCE_SPARSE,
    HYBRID,
    PS,
    PIPELINE,
    FSDP,
    TORCHREC,
    TORCHREC_TW,
    TORCHREC_RW,
    TORCHREC_CW,
)
# Planner candidates that are not a --strategy of their own (hybrid with hot-row caches).
CANDIDATES_ONLY: tuple[StrategySpec, ...] = (HYBRID_CACHE,)


def _plugins() -> tuple[StrategySpec, ...]:
    """The specs named by ``hpar.strategies`` entry points of installed distributions (and of
    ``*.dist-info`` folders on ``sys.path``). Raises ValueError naming an entry point that is
    not a StrategySpec or reuses a built-in name."""
    from importlib.metadata import entry_points

    found = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        spec = ep.load()
        if not isinstance(spec, StrategySpec):
            raise ValueError(f"entry point {ep.name} = {ep.value} ({ENTRY_POINT_GROUP}): not a StrategySpec")
        if spec.name in {s.name for s in BUILT_IN + CANDIDATES_ONLY + tuple(found)}:
            raise ValueError(
                f"entry point {ep.name} = {ep.value} ({ENTRY_POINT_GROUP}): the name {spec.name!r} "
                "is taken; choose another"
            )
        found.append(spec)
    return tuple(found)


_ALL: tuple[StrategySpec, ...] | None = None


def strategies() -> tuple[StrategySpec, ...]:
    """Every runnable strategy's spec: the built-in ones, then those of entry points."""
    global _ALL
    if _ALL is None:
        _ALL = BUILT_IN + _plugins()
    return _ALL


def names() -> tuple[str, ...]:
    """The names ``--strategy`` accepts besides ``auto`` (the CLI's choices)."""
    return tuple(s.name for s in strategies())


def spec(name: str) -> StrategySpec:
    """The spec of strategy ``name`` (a planner candidate such as ``hybrid-cache`` included).
    Raises ValueError naming the choices for an unknown name."""
    for s in strategies() + CANDIDATES_ONLY:
        if s.name == name:
            return s
    raise ValueError(f"--strategy {name!r}: choose one of {', '.join(names())} or auto")


def where(**flags: Any) -> tuple[str, ...]:
    """The names of the runnable strategies whose spec has every attribute in ``flags`` equal
    to the value given, e.g. ``where(servers=True)`` -> ``("ps", "hybrid")``: for messages that
    name the strategies a flag applies to."""
    return tuple(s.name for s in strategies() if all(getattr(s, k) == v for k, v in flags.items()))


__all__ = [
    "StrategySpec",
    "strategies",
    "names",
    "spec",
    "where",
    "BUILT_IN",
    "CANDIDATES_ONLY",
    "ALLREDUCE",
    "ALLREDUCE_SPARSE",
    "PS",
    "HYBRID",
    "HYBRID_CACHE",
    "PIPELINE",
    "FSDP",
    "TORCHREC",
    "TORCHREC_TW",
    "TORCHREC_RW",
    "TORCHREC_CW",
    "ENTRY_POINT_GROUP",
]
