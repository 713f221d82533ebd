"""The user's job as a process runs it, the first stage of the flow.

- ``contract``: the script contract (``model()``, ``batches()``, ``optimizer()``, ...), loaded
  and checked; ``errors``: the user's errors, reported as theirs.
- ``config``: the resolved run configuration (``config.json``), its flags and their checks.
- ``compression``: the ``--compress`` setting.
- ``optimizer_rules``: what the user's optimizer can do (sparse gradients, the servers' rule,
  weight prediction).
- The user's model: ``forward`` (how a batch is fed), ``layers`` (its layers), ``tying``
  (shared parameters, row-sparse tables), ``traced``, ``traced_stage`` and ``block_trace``
  (models that are not a sequence, cut by torch's tracers).
- The process it runs in: ``context`` (what a runtime gets and returns, the meters), ``loop``
  (autocast, clipping, accumulation, schedules, evaluation), ``first_batch``.

May import specs/ and common/ only.
"""
