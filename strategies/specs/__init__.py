"""What each training strategy is, in one place, read by every stage: one spec module per
strategy family, the registry that the CLI's choices, the run config's checks, the planner,
the memory model, the bench and the worker all read, and ``decision`` (the typed Plan).

``registry.py`` lists the built-in specs and the ``hpar.strategies`` entry points (a
strategy added from outside: one module defining a :class:`registry.StrategySpec`, one entry
point naming it). Each spec names its runtime (``train(ctx)``), its cost and memory model and
its probes by ``module:function`` (loaded on first use, as entry points are), so that this
package imports neither torch nor any runtime: the CLI reads the choices without importing
them. A family's settings and the sizes its runtime and its models share live in its spec
module (``servers_spec``: the hot-row cache's settings, row partitions, the wire's buffers).
"""
