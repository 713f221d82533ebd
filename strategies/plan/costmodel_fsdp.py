"""Predicted step time and bytes of ``fsdp``: torch's fully sharded data parallelism (FSDP2,
``torch.distributed.fsdp.fully_shard``, one unit per layer of the model), in the notation and
with the helpers of ``strategies/plan/costmodel.py``.

Every parameter, gradient and optimizer state is split over the N workers (ZeRO stage 3:
Rajbhandari et al., "ZeRO: memory optimizations toward training trillion parameter models",
SC 2020; Zhao et al., "PyTorch FSDP", VLDB 2023). Per step a worker takes part in, for each
unit: an AllGather of its parameters before the forward, another before the backward (the
unit is resharded after its forward), and a ReduceScatter of its gradient after the backward.
A ring AllGather or ReduceScatter of B bytes moves (N-1)/N * B per worker (Thakur et al.,
IJHPCA 2005), so a step moves 3(N-1)/N * P, 1.5x DDP's AllReduce. gloo has no native
ReduceScatter: torch runs it as an AllReduce of the whole gradient (pytorch PR 149869), which
moves 2(N-1)/N * P, so on CPU workers a step moves 4(N-1)/N * P. Frozen parameters
(``requires_grad=False``) are sharded and gathered like the rest, but have no gradient to
reduce-scatter and no update: FSDP2's ``FSDPParamGroup.post_backward`` reduces only the
parameters that hold a gradient, and its backward all-gather unshards a unit whole, frozen
parameters included (a unit before the first trainable one may still be prefetched for
backward, so both AllGathers count every parameter).

FSDP prefetches the next unit's AllGather while the current one computes, so communication
runs under the compute except the first unit's forward AllGather; where the workers fill
their cores (``CostSetting.overlap`` False) it adds up instead. The optimizer steps 1/N of
the parameters. FSDP's own work (copies into and out of the collectives' buffers, DTensors,
hooks per unit) is the profile's ``fsdp_overhead_s``, measured on one worker
(strategies/runtimes/dataparallel/fsdp_cost.py), scaled as compute where workers share cores. Where the
cluster's small collectives were measured (``ClusterSpec.allgather_fixed_s``,
``reduce_scatter_fixed_s``), each unit's collectives pay that fixed time instead of N - 1
latencies. What fsdp buys is memory (strategies/plan/memory_model.py): the planner takes it where
the data-parallel replica does not fit.
"""

from __future__ import annotations

from hpar.strategies.specs.base import ON_ALLREDUCE
from hpar.strategies.specs.fsdp_spec import FSDP
from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.costmodel import Estimate, cost_setting, cpu_share, ring_allgather_s, ring_allreduce_s
from hpar.strategies.profile.records import Profile


def fsdp_bytes(total: float, n: int, gloo: bool, trainable: float | None = None) -> float:
    """Bytes one worker sends per step: two AllGathers of every unit (``total`` parameter bytes)
    and a ReduceScatter of every gradient (``trainable`` bytes, the parameters that are not
    frozen; None: all of ``total``) (module docstring); 0 for one worker."""
    if n <= 1:
        return 0.0
    share = (n - 1) / n * total
    reduced = (n - 1) / n * (total if trainable is None else trainable)
    return 2 * share + (2 * reduced if gloo else reduced)


UNUSED_BY_RANK = (
    "the ranks' batches leave different parameters without a gradient in one step (routing, as in "
    "a mixture of experts), and FSDP2 reduce-scatters only the gradients a rank has, so the ranks' "
    "collectives would differ; use allreduce or hybrid"
)


def estimate_fsdp(profile: Profile, cluster: ClusterSpec) -> Estimate:
    """``fsdp``: step = data + forward with the AllGathers under it + backward with the
    AllGathers and ReduceScatters under it + the first unit's AllGather + the update of
    P/N (module docstring). One worker runs it as a single process (no collective)."""
    if profile.unused_by_rank and cluster.workers > 1:  # strategies/profile/unused.py
        return Estimate(FSDP.name, 0.0, 0, 0.0, feasible=False, note=UNUSED_BY_RANK)
    c = cost_setting(profile, cluster)
    n, total, trained = c.n, float(profile.total_bytes), float(profile.trainable_bytes)
    gloo = profile.device == "cpu"
    units = max(1, len(profile.layers))
    # per unit one collective of each kind: at its measured fixed time where there is one
    gather = ring_allgather_s(
        total / n,
        n,
        c.bw,
        c.lat,
        rounds=units,
        fixed_s=None if c.allgather_fixed is None else units * c.allgather_fixed,
    )
    if gloo and c.reduce_scatter_fixed is not None:  # an AllReduce's bytes, the measured ReduceScatters' fixed time
        scatter = ring_allreduce_s(trained, n, c.bw, 0.0) + units * c.reduce_scatter_fixed
    elif gloo:
        scatter = ring_allreduce_s(trained, n, c.bw, c.lat)
    else:
        scatter = ring_allgather_s(
            trained / n,
            n,
            c.bw,
            c.lat,
            rounds=units,
            fixed_s=None if c.reduce_scatter_fixed is None else units * c.reduce_scatter_fixed,
        )
    first = gather * (profile.layers[0].param_bytes / total if profile.layers and total else 1.0)
    forward = max(c.fwd, gather - first) if c.overlap else c.fwd + gather - first
    update = c.update(trained / n, len(profile.trained))  # every trainable tensor, sharded
    # FSDP's own copies and hooks, measured on one worker (runtimes/dataparallel/fsdp_cost.py); a projected device: not known
    own = cpu_share(cluster) * (profile.fsdp_overhead_s or 0.0) if cluster.device is None else 0.0
    step = c.data + c.host + first + forward + c.under_backward(gather + scatter) + update + own
    return Estimate(
        FSDP.name,
        step,
        n * profile.samples_per_batch,
        fsdp_bytes(total, n, gloo, trained),
        {
            "data": c.data,
            "host": c.host,
            "forward": c.fwd,
            "backward": c.bwd,
            "allgather": 2 * gather,
            "reducescatter": scatter,
            "comm_tail": first,
            "update": update,
            "fsdp_own": own,
        },
        placement={p.name: ON_ALLREDUCE for p in profile.params},
    )
