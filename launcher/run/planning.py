"""The planner as ``hpar run`` uses it: profile the job, describe the cluster, choose a plan."""
from __future__ import annotations


def plan_job(job, batch_size: int, hosts_spec: str | None, gpus: int, servers: int | None,
             schedule: str = "1f1b", force: str | None = None, pipeline_replicas: int | None = None):
    """Profile ``job`` (strategies/profile/profiler.py) for ``gpus`` workers on the hosts of
    ``hosts_spec`` (link figures probed on this machine, or hpar profile's defaults for remote
    hosts) and return the planner's Plan (strategies/plan/planner.py); ``pipeline_replicas``: the
    pipeline's R fixed by ``--pipeline-replicas``. Raises JobError/ValueError."""
    from hpar.launcher.commands.profile import build_cluster
    from hpar.strategies.plan.planner import choose_plan
    from hpar.strategies.profile.profiler import profile_job
    cluster = build_cluster(gpus, hosts_spec, servers, None, None, None)
    profile = profile_job(job, batch_size, cluster.workers)
    return choose_plan(profile, cluster, schedule=schedule, force=force, pipeline_replicas=pipeline_replicas)
