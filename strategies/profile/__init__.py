"""The profiler: measure a user's job on the device its workers will use.

- ``profiler``: :func:`profile_job`, which measures the job.
- ``records``: the :class:`Profile` value the cost model reads (per-parameter sparsity and
  bytes, per-layer forward/backward time, FLOPs, activation bytes), saved as JSON.
- ``hooks``: the instruments (module and tensor hooks for layer timing, FLOP counting).
- ``sparsity``: rows of each embedding table a batch touches, and their union over workers
  (Parallax's alpha, Kim et al., EuroSys 2019, section 4).
- ``update``: the user's optimizer timed on dense and on sparse gradients, and whether the
  parameter servers can apply it.
- ``unused``: which trainable parameters a step leaves without a gradient (DDP's
  find_unused_parameters).

May import ``hpar.strategies.job.contract`` and ``context`` and torch; never the runtimes, the planner,
``hpar.launcher`` or ``hpar.workers``.
"""
