"""The planner: from a Profile and a cluster to a Plan, with the predicted cost of every strategy.

- ``cluster``: :class:`ClusterSpec` (hosts, workers per host, servers, link figures, given by
  flags or measured by a short loopback probe).
- ``costmodel``: predicted step time and bytes per worker per step of allreduce,
  allreduce-sparse and pipeline (ring AllReduce: Patarasuk and Yuan 2009; pipeline bubble:
  GPipe, Huang et al. 2019); ``costmodel_ps`` the same for ps and hybrid (Parallax, Kim et al.,
  EuroSys 2019: placement of each parameter and partition counts).
- ``planner``: the fastest predicted strategy hpar can run, as a :class:`Plan` (JSON-able).

Pure functions of frozen values: may import ``hpar.strategies.profile`` and
``hpar.strategies.runtimes.pipeline.partition``; no process groups, no launcher, no workers.
"""
