"""What each training strategy is, in one place: one spec module per strategy family and the
registry that the CLI's choices, the run config's checks, the planner, the memory model, the
bench and the worker all read.

``registry.py`` lists the built-in specs and the ``hpar.strategies`` entry points (a
strategy added from outside: one module defining a :class:`registry.StrategySpec`, one entry
point naming it). Each spec names its runtime (``train(ctx)``), its cost and memory model by
``module:function`` (loaded on first use, as entry points are), so that this package imports
neither torch nor any runtime: the CLI reads the choices without importing them. The spec
modules import only pure rule modules (strategies/runtimes/pipeline/schedules.py, guard.py).
"""
