"""The census of forward shapes (strategies/profile/shapes.py) and the growth the memory model
draws from it (strategies/plan/memory_model.growth): a worker's caches per shape grow with the
distinct shapes a run of its length meets, not with its steps; through `hpar profile` too."""

import dataclasses
import json
import random

import pytest
import torch
from torch import nn

from conftest import hpar_to_file
from hpar.strategies.plan.memory_model import GROWTH_HORIZON_STEPS, forward_passes, growth
from hpar.strategies.profile.records import MemoryProfile
from hpar.strategies.profile.shapes import STATIC_AFTER, ShapeCensus, distinct_after, draw


def test_rarefaction_meets_the_census_and_one_shape_stays_one():
    counts = (5, 3, 2, 1, 1)
    assert distinct_after(counts, sum(counts)) == pytest.approx(5)
    assert distinct_after(counts, 1) == pytest.approx(1)
    assert distinct_after((48,), 10_000) == 1
    assert distinct_after((), 10) == 0 and distinct_after(counts, 0) == 0
    grown = [distinct_after(counts, n) for n in (1, 4, 12, 100, 10_000)]
    assert grown == sorted(grown) and grown[-1] > 5  # singletons left: more shapes unseen


@pytest.mark.parametrize("kinds", [30, 80, 200])
def test_the_extrapolation_follows_a_known_distribution_on_average(kinds):
    """Censuses of 48 draws of K equally likely shapes: the distinct shapes of 200 and of 1,000
    draws, averaged over 40 censuses, within 15% of the exact K (1 - (1 - 1/K)^n) (one census
    of 48 can miss by a factor of 2: the estimator's spread, not its bias)."""
    for n in (200, 1000):
        estimates = []
        for seed in range(40):
            rng, met = random.Random(seed * 1000 + kinds), {}
            for _ in range(48):
                k = rng.randrange(kinds)
                met[k] = met.get(k, 0) + 1
            estimates.append(distinct_after(tuple(met.values()), n))
        exact = kinds * (1 - (1 - 1 / kinds) ** n)
        assert sum(estimates) / len(estimates) == pytest.approx(exact, rel=0.15), n


class Varying(nn.Module):
    """Its hidden width depends on the batch, as a sampled softmax's candidates do."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 4)

    def forward(self, x):
        return self.emb(torch.unique(x))


def test_the_census_counts_signatures_and_stops_early_on_static_shapes():
    net = Varying()
    g = torch.Generator().manual_seed(0)
    batches = iter([torch.randint(0, 100, (20,), generator=g) for _ in range(200)])
    with ShapeCensus(net) as census:
        draw(census, net, batches, most=40, budget_s=30)
    assert sum(census.counts()) == 40 and 5 < len(census.counts()) < 40
    fixed = nn.Linear(3, 2)
    calls = iter([torch.ones(2, 3)] * 100)
    with ShapeCensus(fixed) as census:
        draw(census, fixed, calls, most=40, budget_s=30)
    assert census.counts() == (STATIC_AFTER,)
    assert next(calls) is not None and len(list(calls)) == 100 - STATIC_AFTER - 1  # it stopped drawing


def _memory(**kw) -> MemoryProfile:
    return MemoryProfile(
        batch_size=32,
        layer_saved_bytes=(0,),
        forward_peak_bytes=0,
        step_peak_bytes=0,
        step_grad_bytes=0,
        data_bytes=0,
        optimizer_state_ratio=0.0,
        process_bytes=0,
        **kw,
    )


def test_growth_counts_bytes_per_new_shape_times_the_shapes_a_run_meets():
    varying = _memory(
        growth_bytes=10_000_000, growth_steps=6, growth_new_shapes=5, shape_counts=(4, 4, 3, 3, 2, 2, 2) + (1,) * 20
    )
    short, mid, long, longer = (growth(varying, n) for n in (8, 40, 200, 2000))
    assert 0 < short < mid < long < longer < 2e6 * (distinct_after(varying.shape_counts, 10**6))
    assert long == pytest.approx(2e6 * (distinct_after(varying.shape_counts, 200) - 1))
    static = dataclasses.replace(varying, growth_new_shapes=0, shape_counts=(48,))
    assert growth(static, 8) == growth(static, 2000) == 10_000_000  # kept once, whatever the length
    legacy = dataclasses.replace(varying, shape_counts=())
    assert growth(legacy, 8) == growth(legacy, 2000) == 10_000_000 * GROWTH_HORIZON_STEPS / 6
    assert growth(_memory(), 100) == 0


def test_forward_passes_are_steps_times_accumulation():
    assert forward_passes(10, 4) == 40 and forward_passes(10, None) == forward_passes(10, 0) == 10
    assert forward_passes(None, 4) is None and forward_passes(0, 2) is None


# A model that keeps a buffer per input length (as a positional table cached per sequence
# length does), fed batches of varying length (as length-bucketed text is): its worker's memory
# grows with every new length it meets, about 4.7 MB each here.
VARYING_JOB = """
import torch, torch.nn as nn
HPAR = {"steps": STEPS, "batch_size": 16, "lr": 0.1}
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 1)
        self.tables = {}
    def forward(self, x):
        length = x.shape[1]
        if length not in self.tables:
            self.tables[length] = torch.randn(length, 32768)
        return self.proj(x + self.tables[length][:, :8]).mean((1, 2))
def model(): return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        length = LENGTH
        yield torch.randn(batch_size, length, 8, generator=g), torch.zeros(batch_size)
def loss(o, t): return ((o - t) ** 2).mean()
"""


def test_profile_grows_a_varying_models_memory_with_the_runs_length(tmp_path):
    """`hpar profile --json` on the same job at HPAR steps 4 and 400: the growth term of a
    model whose shapes change grows with the run's length (a static model's stays the same:
    the unit test above)."""
    terms = {}
    for steps in (4, 400):
        text = VARYING_JOB.replace("STEPS", str(steps))
        text = text.replace("LENGTH", "int(torch.randint(8, 64, (1,), generator=g))")
        script = tmp_path / f"job{steps}.py"
        script.write_text(text)
        rc, log = hpar_to_file(
            tmp_path / f"out{steps}.txt", "profile", str(script), "--gpus", "2", "--json", cwd=str(tmp_path)
        )
        assert rc == 0, log[-2000:]
        plan = json.loads(log[log.index("{") :])
        row = next(c for c in plan["candidates"] if c["strategy"] == "allreduce")
        terms[steps] = row["memory"]["worker_terms"]["growth"]
    # about 3 new lengths of 56 against nearly all 56 (4.7 MB each): several times more
    assert terms[400] > 3 * terms[4] > 0 and terms[400] > 100e6, terms
