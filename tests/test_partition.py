"""The pipeline partitioner: contiguous stages minimising the slowest stage."""

import itertools
import random

import pytest

from hpar.strategies.plan.partition import StagePlan, balanced_ranges, partition_stages, stage_send_s


def brute_force_bottleneck(compute, act, k, bw):
    n = len(compute)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        worst = max(sum(compute[a:b]) + stage_send_s(a, b, act, bw) for a, b in zip(bounds, bounds[1:]))
        best = min(best, worst)
    return best


def test_uniform_layers_split_evenly():
    plan = partition_stages([1.0] * 8, [0] * 8, [10] * 8, 4, 1e9)
    assert isinstance(plan, StagePlan)
    assert plan.ranges == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert plan.stage_s == (2.0, 2.0, 2.0, 2.0)


def test_heavy_layer_gets_its_own_stage():
    plan = partition_stages([1, 1, 6, 1, 1, 1], [0] * 6, [0] * 6, 3, 1e9)
    assert (2, 3) in plan.ranges
    assert plan.bottleneck_s == 6


def test_communication_moves_the_cut_to_a_small_activation():
    # Equal compute; cutting after layer 1 sends 1000 bytes, after layer 2 only 1 byte.
    compute = [1.0, 1.0, 1.0, 1.0]
    act = [1000, 1000, 1, 1000]
    plan = partition_stages(compute, act, [0] * 4, 2, bandwidth_Bps=100.0)
    # With 100 B/s a 1000-byte cut costs 10 s: the 1-byte cut wins despite 3 layers vs 1.
    assert plan.ranges == ((0, 3), (3, 4))
    assert plan.stage_s == pytest.approx((3.01, 1.01))
    cheap = partition_stages([1.0] * 4, [1000, 1, 1000, 1000], [0] * 4, 2, bandwidth_Bps=100.0)
    assert cheap.ranges == ((0, 2), (2, 4))
    assert cheap.stage_s == (2.0 + 0.01, 2.0 + 0.01)


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    n, k = rng.randint(2, 8), rng.randint(1, 4)
    k = min(k, n)
    compute = [rng.uniform(0.1, 5.0) for _ in range(n)]
    act = [rng.randint(0, 1000) for _ in range(n)]
    plan = partition_stages(compute, act, [rng.randint(0, 100) for _ in range(n)], k, 500.0)
    assert len(plan.ranges) == k
    assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == n
    assert all(a < b for a, b in plan.ranges)
    assert all(b == a2 for (_, b), (a2, _) in zip(plan.ranges, plan.ranges[1:]))
    assert plan.bottleneck_s == pytest.approx(brute_force_bottleneck(compute, act, k, 500.0))


def test_memory_estimate_counts_params_grads_optimizer_and_in_flight_activations():
    plan = partition_stages([1.0, 1.0], [7, 5], [100, 300], 2, 1e12)
    assert plan.ranges == ((0, 1), (1, 2))
    # stage 0: 100 * (2 + 1) + 2 in-flight micro-batches * 7; stage 1: 300 * 3 + 1 * 5
    assert plan.memory_bytes == (100 * 3 + 2 * 7, 300 * 3 + 5)
    stash = partition_stages([1.0, 1.0], [7, 5], [100, 300], 2, 1e12, weight_versions=True)
    assert stash.memory_bytes == (100 * 3 + 2 * 7 + 100, 300 * 3 + 5)


def test_fewer_layers_than_stages_names_the_flag():
    with pytest.raises(
        ValueError,
        match=r"4 pipeline stages \(--gpus / --pipeline-replicas\): the model has only 3 layers; use 3 stages or fewer",
    ):
        partition_stages([1.0] * 3, [0] * 3, [0] * 3, 4, 1e9)


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        partition_stages([1.0, 1.0], [0], [0, 0], 2, 1e9)
    with pytest.raises(ValueError):
        partition_stages([1.0, -1.0], [0, 0], [0, 0], 2, 1e9)
    with pytest.raises(ValueError):
        partition_stages([1.0, 1.0], [0, 0], [0, 0], 2, 0.0)


def test_balanced_ranges_on_parameter_counts():
    assert balanced_ranges([4, 1, 1, 1, 1], 2) == ((0, 1), (1, 5))
    assert balanced_ranges([1, 1, 1, 1], 4) == ((0, 1), (1, 2), (2, 3), (3, 4))
