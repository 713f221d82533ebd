"""Split a sequence of layers into contiguous pipeline stages (PipeDream's planner).

A model of L layers (the children of an ``nn.Sequential``) is cut into K contiguous stages,
one per process. The cut minimises the time of the slowest stage, because in a pipeline
that runs many micro-batches the slowest stage sets the rate of the whole pipeline.
The algorithm is the dynamic program of PipeDream's partitioner (Narayanan et al.,
"PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019, section 3.1),
without replication of stages.

Cost of one stage ``[a, b)`` per micro-batch (seconds)::

    stage_s = sum(compute_s[a:b])                          # forward + backward of its layers
            + (activation_bytes[b-1] if b < L else 0) / bandwidth_Bps   # output activation
            + (activation_bytes[a-1] if a > 0 else 0) / bandwidth_Bps   # gradient of its input

i.e. compute plus everything the stage sends per micro-batch: its output activation forward
and the gradient of its input backward (which has the size of the previous stage's output).
Communication is assumed not to overlap computation (an upper bound, as in PipeDream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StagePlan:
    """K contiguous stages.

    ``ranges``: ``[start, end)`` layer indices of each stage, covering ``0..L`` in order.
    ``stage_s``: seconds per micro-batch per stage (compute + sending, see module docstring).
    ``memory_bytes``: estimated bytes a stage holds, see :func:`stage_memory_bytes`.
    """

    ranges: tuple[tuple[int, int], ...]
    stage_s: tuple[float, ...]
    memory_bytes: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    @property
    def bottleneck_s(self) -> float:
        """Seconds per micro-batch of the slowest stage (the pipeline's steady-state period)."""
        return max(self.stage_s)


def stage_send_s(a: int, b: int, activation_bytes: Sequence[int], bandwidth_Bps: float) -> float:
    """Seconds stage ``[a, b)`` spends sending per micro-batch: its output activation
    (unless it is the last stage) plus the gradient of its input (unless it is the first)."""
    n = len(activation_bytes)
    sent = (activation_bytes[b - 1] if b < n else 0) + (activation_bytes[a - 1] if a > 0 else 0)
    return sent / bandwidth_Bps


def stage_memory_bytes(
    a: int,
    b: int,
    stage: int,
    num_stages: int,
    activation_bytes: Sequence[int],
    param_bytes: Sequence[int],
    optimizer_states: int = 1,
    weight_versions: bool = False,
) -> int:
    """Estimated bytes held by stage ``stage`` (0-based) owning layers ``[a, b)`` in 1F1B.

    params + gradients + ``optimizer_states`` copies of the params (1 = SGD momentum, 2 = Adam)
    + activations of the in-flight micro-batches: in 1F1B stage k has at most K-k micro-batches
    between their forward and their backward, each keeping the outputs of all its layers
    (``sum(activation_bytes[a:b])``, an upper bound on what autograd saves)
    + with ``weight_versions`` (PipeDream weight stashing) K-k-1 extra copies of the params.
    """
    params = sum(param_bytes[a:b])
    in_flight = num_stages - stage
    total = params * (2 + optimizer_states) + in_flight * sum(activation_bytes[a:b])
    if weight_versions:
        total += (in_flight - 1) * params
    return int(total)


def partition_stages(
    compute_s: Sequence[float],
    activation_bytes: Sequence[int],
    param_bytes: Sequence[int],
    num_stages: int,
    bandwidth_Bps: float,
    *,
    optimizer_states: int = 1,
    weight_versions: bool = False,
) -> StagePlan:
    """Cut L layers into ``num_stages`` contiguous stages minimising the slowest stage's time.

    Inputs are per layer, in model order, for ONE micro-batch: ``compute_s`` forward+backward
    seconds, ``activation_bytes`` bytes of the layer's output, ``param_bytes`` bytes of its
    parameters. ``bandwidth_Bps`` is the link bandwidth between neighbouring stages in bytes/s
    (``float('inf')`` for free communication). Keyword arguments shape the memory estimate
    only (see :func:`stage_memory_bytes`).

    Dynamic programming as in PipeDream (Narayanan et al., SOSP 2019):
    ``best[m][j]`` = smallest bottleneck for the first j layers in m stages
    = min over i of max(best[m-1][i], cost(i, j)); O(K * L^2). The bottleneck is exact; among
    cuts with the same bottleneck the DP prefers a smaller sum of squared stage times (so the
    other stages are balanced too), then the earliest cut, so the result is deterministic.

    Raises ValueError when the lists differ in length, when a value is negative, when the
    bandwidth is not positive, or when there are fewer layers than stages (``--gpus``).
    """
    n = len(compute_s)
    if len(activation_bytes) != n or len(param_bytes) != n:
        raise ValueError(
            f"partition_stages: compute_s, activation_bytes and param_bytes must have one entry per layer, got {n}, {len(activation_bytes)}, {len(param_bytes)}"
        )
    if num_stages < 1:
        raise ValueError(
            f"{num_stages} pipeline stages (--gpus / --pipeline-replicas): a pipeline needs at least 1 stage"
        )
    if n < num_stages:
        raise ValueError(
            f"{num_stages} pipeline stages (--gpus / --pipeline-replicas): the model has only {n} layers; use {n} stages or fewer (lower --gpus or raise --pipeline-replicas), or split the model into more layers"
        )
    if any(c < 0 for c in compute_s) or any(x < 0 for x in activation_bytes) or any(x < 0 for x in param_bytes):
        raise ValueError("partition_stages: layer times and byte counts must not be negative; check the profile")
    if not bandwidth_Bps > 0:
        raise ValueError(f"partition_stages: bandwidth must be positive, got {bandwidth_Bps}; check --bandwidth")

    prefix = [0.0]
    for c in compute_s:
        prefix.append(prefix[-1] + float(c))

    def cost(a: int, b: int) -> float:
        return prefix[b] - prefix[a] + stage_send_s(a, b, activation_bytes, bandwidth_Bps)

    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for m in range(1, num_stages + 1):
        # m stages cover j layers, each stage at least one layer, leaving room for the rest.
        for j in range(m, n - (num_stages - m) + 1):
            for i in range(m - 1, j):
                c = cost(i, j)
                value = (max(best[m - 1][i][0], c), best[m - 1][i][1] + c * c)
                if value < best[m][j]:
                    best[m][j], cut[m][j] = value, i
    ranges = []
    j = n
    for m in range(num_stages, 0, -1):
        i = cut[m][j]
        ranges.append((i, j))
        j = i
    ranges.reverse()
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    stage_s = tuple(cost(a, b) for a, b in ranges)
    memory = tuple(
        stage_memory_bytes(a, b, k, num_stages, activation_bytes, param_bytes, optimizer_states, weight_versions)
        for k, (a, b) in enumerate(ranges)
    )
    return StagePlan(ranges=tuple(ranges), stage_s=stage_s, memory_bytes=memory)


def balanced_ranges(weights: Sequence[float], num_stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous ranges balancing ``weights`` (e.g. parameter counts per layer) when no
    profile is at hand: :func:`partition_stages` with the weights as compute and free
    communication. Raises ValueError as it does."""
    n = len(weights)
    return partition_stages(list(weights), [0] * n, [0] * n, num_stages, float("inf")).ranges
