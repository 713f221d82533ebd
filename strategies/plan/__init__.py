"""The planner and everything decided before a process starts: from a Profile and a cluster
to a Plan, with the predicted cost of every strategy.

- ``cluster`` and ``probe*``: :class:`ClusterSpec` (hosts, workers, servers, link figures, given
  by flags or measured by short probes).
- ``costmodel*``, ``estimates``, ``roofline``: predicted step time and bytes per worker per step
  (ring AllReduce: Patarasuk and Yuan 2009; Parallax's placement and partitions: Kim et al.,
  EuroSys 2019; pipeline bubble: GPipe, Huang et al. 2019); ``memory_model``,
  ``memory_sharded``, ``pipeline_fit``: each process's predicted peak memory.
- ``planner``: the fastest predicted strategy hpar can run, as a Plan; ``vet``: the run's
  refusals applied to every candidate; ``tuning``: ``--tune``'s short trials.
- ``partition``, ``schedules``, ``stage_cuts``, ``pipeline_grid``: a pipeline's balanced
  stages (PipeDream's planner), each stage's order of passes (GPipe, 1F1B, asynchronous), where
  the model is cut, which rank holds which stage of which replica.
- ``placement``: which parameter the parameter servers hold and with which update rule.
- ``strategy_settings``, ``compress_setting``, ``capacity``, ``fit``, ``peaks``: the run's
  settings per strategy and its memory fit, checked before start.

May import specs/, common/, job/, state/ and profile/; never a runtime.
"""
