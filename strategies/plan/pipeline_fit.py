"""The pipeline layout the planner offers under a memory limit: the fastest K stages x R
replicas (K x R = the workers; both rank layouts; M micro-batches) whose predicted peak fits.

A pipeline's peak per worker depends on its layout: fewer, larger stages hold more parameters,
gradients and optimizer state each, and replicas add the gradients flattened for the
replicas' AllReduce (strategies/plan/memory_model.pipeline_terms). The fastest layout of 4
workers is often 2 stages x 2 replicas, the smallest 4 stages x 1 replica; a memory limit that
only the second fits must not refuse the pipeline. The planner asks :func:`fitting_layout` for
the pipeline candidate before it checks the candidate's memory, so the profile table, ``hpar
run --strategy pipeline`` and ``auto`` see the layout that fits (and the note says the faster
one did not); the pipeline is refused only when no layout fits.
"""

from __future__ import annotations

import dataclasses

from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.costmodel import Estimate
from hpar.strategies.plan.costmodel_pipeline import describe, pipeline_grid_estimates
from hpar.strategies.plan.memory_model import predict
from hpar.strategies.profile.records import Profile


def fitting_layout(
    profile: Profile,
    cluster: ClusterSpec,
    est: Estimate,
    schedule: str,
    forwards: int | None = None,
    replicas: int | None = None,
) -> Estimate:
    """``est`` (the fastest pipeline plan, costmodel_pipeline.py) when its predicted peak fits
    ``cluster``'s memory, or the memory is not known; else the fastest plan of
    :func:`pipeline_grid_estimates` (``replicas``: only that R) that fits under ``schedule``
    (``forwards``: the forward passes per worker, as memory_model.predict takes them), its
    ``note`` naming the faster layout that does not fit; ``est`` itself when none fits (the
    planner then refuses it with the reason)."""
    if not est.feasible or not predict(profile, cluster, est, schedule, forwards).misfit(cluster):
        return est
    for alt in pipeline_grid_estimates(profile, cluster, replicas):
        if alt.feasible and not predict(profile, cluster, alt, schedule, forwards).misfit(cluster):
            why = f"the faster {_shape(est)} does not fit the memory"
            return dataclasses.replace(alt, note=why + ("; " + alt.note if alt.note else ""))
    return est


def _shape(est: Estimate) -> str:
    """ "2 stages x 2 replicas" or "4 stages" (describe()'s first words)."""
    return describe(est).split(" (", 1)[0].split(",", 1)[0]


__all__ = ["fitting_layout"]
