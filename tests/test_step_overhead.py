"""The host's own seconds in a step on a GPU (strategies/profile/step_overhead.py): a whole step
is timed as a worker runs it, the figure is measured on accelerators only, and the cost model
charges it to every strategy's step."""

import dataclasses
import textwrap

import pytest
import torch

from hpar.strategies.job.contract import load_job
from hpar.strategies.job.loop import precision_context
from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.estimates import estimate_all, estimate_async_pipeline
from hpar.strategies.profile import step_overhead
from hpar.strategies.profile.profiler import profile_job

SLOW_DATA = textwrap.dedent("""
    import time
    import torch
    from torch import nn

    def model():
        return nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(24, 4))

    def data(rank, world_size, batch_size):
        g = torch.Generator().manual_seed(rank)
        while True:
            time.sleep(DRAW_S)   # the host's work between the timed parts
            yield torch.randint(0, 50, (batch_size, 3), generator=g), torch.randint(0, 4, (batch_size,), generator=g)

    def loss(output, targets):
        return nn.functional.cross_entropy(output, targets)
""")


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.py"
    path.write_text("DRAW_S = 0.02\n" + SLOW_DATA)
    return load_job(str(path))


def test_a_whole_step_is_timed_as_a_worker_runs_it_and_measured_on_accelerators_only(job):
    """whole_step_s takes the batch draw, forward, backward, the loss's .item() and the
    optimizer in one step (20 ms of drawing shows in it); step_overhead_s is None on a CPU,
    where the profile's parts are host wall times already, and for a model over MAX_BYTES."""
    cast = precision_context("fp32", "cpu")
    model = job.build_model()
    before = [p.detach().clone() for p in model.parameters()]
    whole = step_overhead.whole_step_s(job, model, torch.device("cpu"), cast, job.batches(0, 1, 4), steps=3)
    assert 0.02 <= whole < 0.5
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the optimizer stepped
    two = iter([next(job.batches(0, 1, 4))] * 2)  # a data stream shorter than the warm-up: nothing timed
    assert step_overhead.whole_step_s(job, model, torch.device("cpu"), cast, two, steps=3) is None
    assert step_overhead.step_overhead_s(job, torch.device("cpu"), cast, 4, 1, 0.0) is None
    assert (
        step_overhead.step_overhead_s(job, torch.device("cuda"), cast, 4, 1, 0.0, step_overhead.MAX_BYTES + 1) is None
    )


def test_the_host_seconds_are_charged_to_every_strategys_step(job):
    """A profile with step_overhead_s (a GPU's) adds it once to every strategy's predicted step,
    the asynchronous pipelines' too, as breakdown["host"]; without it nothing changes."""
    prof = profile_job(job, batch_size=4, workers=2, repeats=2)
    assert prof.step_overhead_s is None  # profiled on the CPU
    cluster = ClusterSpec(1, (2,), 1, 1e9, 1e-4)
    base = {e.strategy: e for e in estimate_all(prof, cluster) if e.feasible}
    charged = {
        e.strategy: e for e in estimate_all(dataclasses.replace(prof, step_overhead_s=0.004), cluster) if e.feasible
    }
    assert set(base) == set(charged) and {"allreduce", "hybrid", "ps", "pipeline"} <= set(base)
    for name, est in charged.items():
        assert est.step_s == pytest.approx(base[name].step_s + 0.004), name
        assert est.breakdown["host"] == 0.004 and base[name].breakdown["host"] == 0.0
    for schedule in ("async", "async-predict"):
        assert estimate_async_pipeline(charged["pipeline"], schedule).step_s == pytest.approx(
            estimate_async_pipeline(base["pipeline"], schedule).step_s + 0.004
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the figure is measured on accelerators only)")
def test_on_a_gpu_the_host_seconds_are_measured_and_charged(job):
    """On a GPU the profile measures the host's own seconds a step (the 20 ms data draw is
    charged as data_s, so it is not in them), and every strategy's breakdown carries them."""
    prof = profile_job(job, batch_size=4, workers=1, repeats=2, device="cuda")
    assert prof.step_overhead_s is not None and 0.0 <= prof.step_overhead_s < 0.02 <= prof.data_s
    est = estimate_all(prof, ClusterSpec(1, (1,), 1, 1e9, 1e-4))[0]
    assert est.breakdown["host"] == prof.step_overhead_s
