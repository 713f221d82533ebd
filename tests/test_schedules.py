"""Pipeline schedules: orders, version distances, deadlock freedom, bubble."""

import pytest

from hpar.strategies.plan.schedules import Op, bubble_fraction, execution_order, is_synchronous, stage_ops


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async", "async-stash", "async-predict"])
@pytest.mark.parametrize("k,m", [(1, 1), (2, 1), (2, 4), (3, 5), (4, 4), (4, 2), (8, 16)])
def test_every_micro_batch_once_forward_before_backward(schedule, k, m):
    for stage in range(k):
        ops = stage_ops(schedule, k, stage, m)
        assert sorted(op.micro for op in ops if op.kind == "F") == list(range(m))
        assert sorted(op.micro for op in ops if op.kind == "B") == list(range(m))
        seen = set()
        for op in ops:
            if op.kind == "F":
                seen.add(op.micro)
            else:
                assert op.micro in seen
    execution_order([stage_ops(schedule, k, s, m) for s in range(k)])  # raises on deadlock


def test_1f1b_order_and_in_flight_limit():
    ops = stage_ops("1f1b", 4, 0, 6)
    assert [(o.kind, o.micro) for o in ops] == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("F", 3),
        ("B", 0),
        ("F", 4),
        ("B", 1),
        ("F", 5),
        ("B", 2),
        ("B", 3),
        ("B", 4),
        ("B", 5),
    ]
    for stage in range(4):
        in_flight, most = 0, 0
        for op in stage_ops("1f1b", 4, stage, 10):
            in_flight += 1 if op.kind == "F" else -1
            most = max(most, in_flight)
        assert most == 4 - stage
    last = stage_ops("1f1b", 4, 3, 3)
    assert [(o.kind, o.micro) for o in last] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


def test_gpipe_order():
    assert [(o.kind, o.micro) for o in stage_ops("gpipe", 3, 1, 3)] == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("B", 1),
        ("B", 2),
    ]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k,m", [(2, 4), (3, 6), (4, 8)])
def test_synchronous_step_takes_2_m_plus_k_minus_1_ticks(schedule, k, m):
    ticks = execution_order([stage_ops(schedule, k, s, m) for s in range(k)])
    assert len(ticks) == 2 * (m + k - 1)
    busy = sum(len(t) for t in ticks) / (k * len(ticks))
    assert 1 - busy == pytest.approx(bubble_fraction(k, m))


def test_synchronous_distances_are_zero():
    for schedule in ("gpipe", "1f1b"):
        assert all(op.distance == 0 for s in range(4) for op in stage_ops(schedule, 4, s, 8))


@pytest.mark.parametrize("k", [2, 4, 8])
def test_async_version_distance_is_k_minus_1_minus_stage_for_forwards(k):
    n = 4 * k
    for stage in range(k):
        ops = stage_ops("async-predict", k, stage, n)
        for op in ops:
            if op.kind == "B":
                assert op.distance == 0
            else:
                assert op.distance == min(op.micro, k - 1 - stage)


def test_async_distance_counts_updates_between_pass_and_own_update():
    # Direct count on stage 1 of 3: weights seen by a pass = backwards run before it.
    ops = stage_ops("async", 3, 1, 5)
    for i, op in enumerate(ops):
        updates_before = sum(1 for o in ops[:i] if o.kind == "B")
        assert op.distance == op.micro - updates_before


def test_async_steady_state_overlaps_all_stages():
    ticks = execution_order([stage_ops("async", 4, s, 40) for s in range(4)])
    # Without flushes only the start and the end idle: far fewer ticks than 10 flushed steps.
    assert len(ticks) == 2 * (40 + 4 - 1)
    flushed = 10 * 2 * (4 + 4 - 1)
    assert len(ticks) < flushed


def test_deadlock_detected():
    bad = [(Op("F", 0), Op("B", 0)), (Op("B", 0), Op("F", 0))]
    with pytest.raises(ValueError, match="deadlock"):
        execution_order(bad)


def test_unknown_schedule_names_the_flag():
    with pytest.raises(ValueError, match="--schedule"):
        is_synchronous("torch-1f1b")
    with pytest.raises(ValueError, match="--micro-batches"):
        stage_ops("1f1b", 2, 0, 0)
