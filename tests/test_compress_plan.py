"""``--compress`` planned (issue 66): the profile measures the compression's own compute on the
workers' device (strategies/profile/compress_cost.py) and the cost model uses it; ``--strategy
auto`` / ``hpar profile`` with ``--compress`` may choose a compressed plan, and never without it
(strategies/plan/costmodel_compress.shown_rows, planner.choose_plan); the run takes the plan's
compression (strategies/plan/compress_setting.from_plan)."""

import dataclasses
import json
import math

import pytest
import torch

from conftest import hpar_to_file, write_script

# weight matrices PowerSGD compresses at rank 2 ((n + m) r * 2 < n m), biases it sends whole
WIDE = """
import torch, torch.nn as nn
HPAR = {"steps": 4, "batch_size": 8, "lr": 0.1, "log_every": 1}
def model():
    return nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 1))
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(1000 + rank)
    while True:
        x = torch.randn(batch_size, 64, generator=g)
        yield x, x.sum(1, keepdim=True)
def loss(output, targets):
    return ((output - targets) ** 2).mean()
def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
"""


def test_the_compressions_compute_is_measured_grows_with_the_gradients_and_is_what_the_cost_model_uses():
    """PowerSGD's and the 16-bit casts' seconds per step, timed on the CPU for a small and a
    64x larger set of dense shapes: positive, finite, larger for the larger gradients; the
    Profile keeps them through JSON (an older profile reads as not measured), and the cost
    model's compressed estimate adds the measured seconds (not its roofline) to the step."""
    from hpar.strategies.job.compression import Compression
    from hpar.strategies.plan.cluster import ClusterSpec
    from hpar.strategies.plan.costmodel import cpu_share, estimate_allreduce
    from hpar.strategies.plan.costmodel_compress import estimate_compressed
    from hpar.strategies.profile.compress_cost import MEASURED, compression_seconds
    from hpar.strategies.profile.records import Profile
    from test_memory_model import profile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        small = dict(compression_seconds([(64, 64), (64,), (64, 32)], torch.device("cpu"), 2))
        large = dict(compression_seconds([(512, 512), (512,), (512, 256)], torch.device("cpu"), 2))
    finally:
        torch.set_num_threads(threads)
    assert set(small) == set(large) == {str(c) for c in MEASURED}
    for setting in small:
        assert 0 < small[setting] < math.inf and 0 < large[setting] < math.inf, setting
    assert large["powersgd:2"] > small["powersgd:2"] and large["fp16"] > small["fp16"]

    prof = dataclasses.replace(profile(), compress_s=(("powersgd:4", 0.25, 0.0), ("fp16", 0.01, 0.0)))
    back = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert back.compression_s("powersgd:4") == (0.25, 0.0) and back.compression_s("powersgd:2") is None
    old = prof.to_dict()
    del old["compress_s"]
    assert Profile.from_dict(old).compress_s is None
    slow = ClusterSpec(hosts=2, gpus_per_host=(1, 1), servers=1, bandwidth_Bps=25e6 / 8, latency_s=1e-3)
    base = estimate_allreduce(prof, slow)
    low = estimate_compressed(prof, slow, base, Compression("powersgd", 4))
    assert low.breakdown["compress_measured"] == 1.0
    assert low.breakdown["compress_work"] == pytest.approx(cpu_share(slow) * 0.25)
    guessed = estimate_compressed(profile(), slow, estimate_allreduce(profile(), slow), Compression("powersgd", 4))
    assert (
        guessed.breakdown["compress_measured"] == 0.0
        and guessed.breakdown["compress_work"] != low.breakdown["compress_work"]
    )


def test_a_model_over_the_cap_is_timed_on_the_tensors_that_fit_and_scaled(monkeypatch):
    """profile_compression times at most CAP bytes of gradients at once: a dense group over it is
    timed on its tensors that fit and scaled up (positive); a table group none of whose
    tensors fits is not measured (-1.0, the cost model's estimate then)."""
    from hpar.strategies.profile import compress_cost

    model = torch.nn.Sequential(torch.nn.Embedding(1000, 16), torch.nn.Linear(16, 64), torch.nn.Linear(64, 64))
    monkeypatch.setattr(compress_cost, "CAP", 4 * (64 * 16 + 64))  # the first Linear's weight and bias
    got = {s: (d, t) for s, d, t in compress_cost.profile_compression(model, {"0.weight"}, torch.device("cpu"), 2)}
    assert all(0 < d < math.inf and t == -1.0 for d, t in got.values())


def test_auto_with_compress_may_choose_a_compressed_plan_and_the_run_takes_the_plans_compression():
    """On a synthetic profile whose dense AllReduce dominates (four 1000 x 25000 layers, two
    hosts at 25 Mbit/s, no pipeline): without --compress no compressed row is runnable and none is chosen;
    with --compress powersgd:4 its rows are runnable and the plan is the fastest of them,
    compressed; compress_setting.from_plan then runs the plan's setting, and says so where the
    planner weighed it and chose the strategy uncompressed."""
    from hpar.strategies.job.compression import Compression
    from hpar.strategies.plan.cluster import ClusterSpec
    from hpar.strategies.plan.compress_setting import from_plan
    from hpar.strategies.plan.planner import choose_plan
    from test_memory_model import profile

    prof = dataclasses.replace(profile(), compress_s=(("powersgd:4", 0.05, 0.0),), is_sequential=False)  # no pipeline
    slow = ClusterSpec(hosts=2, gpus_per_host=(1, 1), servers=1, bandwidth_Bps=25e6 / 8, latency_s=1e-3)
    plain = choose_plan(prof, slow)
    assert plain.compress == "" and not [c for c in plain.candidates if " --compress " in c.strategy and c.available]
    asked = choose_plan(prof, slow, compress=Compression("powersgd", 4))
    rows = {c.strategy: c for c in asked.candidates}
    assert rows["allreduce --compress powersgd:4"].available and not rows["allreduce --compress fp16"].available
    best = max((c for c in asked.candidates if c.available), key=lambda c: c.samples_per_s)
    assert asked.compress == "powersgd:4" and best.strategy == f"{asked.strategy} --compress powersgd:4"
    assert asked.samples_per_s == pytest.approx(best.samples_per_s) and "--compress powersgd:4" in asked.reason
    said = []
    c = Compression("powersgd", 4)
    assert from_plan(said.append, c, asked) == c and from_plan(said.append, c, plain) == c and not said
    # a compressed plan (a --plan file) run without --compress: uncompressed, said in one line
    assert from_plan(said.append, None, asked) is None and len(said) == 1 and "--compress powersgd:4" in said[0]
    said.clear()
    assert from_plan(said.append, None, plain) is None and not said  # nothing chosen: nothing said
    lost = dataclasses.replace(asked, compress="")  # weighed and not chosen: uncompressed, in one line
    assert from_plan(said.append, c, lost) == Compression() and len(said) == 1 and "uncompressed" in said[0]


def _last_json(out: str) -> dict:
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))


@pytest.mark.timeout(300)
def test_hpar_profile_with_compress_lists_runnable_compressed_rows_and_chooses_the_fastest(tmp_path):
    """The real ``hpar profile --json`` over a 25 Mbit/s link: with ``--compress powersgd:2``
    the profile records the measured compression compute, the powersgd:2 rows are runnable (the
    fp16 rows shown, not runnable) and the plan is the fastest runnable candidate (within the
    planner's tie), its ``compress`` set where that is a compressed row; without ``--compress``
    no compressed row is runnable and the plan is uncompressed."""
    from hpar.strategies.plan.plan_reasons import TIE

    script = write_script(tmp_path, WIDE, "wide.py")
    link = ("--gpus", "2", "--bandwidth", "25Mbps", "--latency", "1ms", "--json")
    code, out = hpar_to_file(tmp_path / "asked.json", "profile", script, *link, "--compress", "powersgd:2")
    assert code == 0, out[-3000:]
    d = _last_json(out)
    measured = {s: (dense, tables) for s, dense, tables in d["profile"]["compress_s"]}
    assert 0 < measured["powersgd:2"][0] < math.inf and measured["powersgd:2"][1] == 0.0
    rows = {c["strategy"]: c for c in d["candidates"]}
    assert rows["allreduce --compress powersgd:2"]["available"] and not rows["allreduce --compress fp16"]["available"]
    assert rows["allreduce --compress powersgd:2"]["breakdown"]["compress_measured"] == 1.0
    runnable = [c for c in d["candidates"] if c["available"]]
    top = max(c["samples_per_s"] for c in runnable)
    name = d["plan"]["strategy"] + (f" --compress {d['plan']['compress']}" if d["plan"]["compress"] else "")
    assert rows[name]["available"] and rows[name]["samples_per_s"] >= top * (1 - TIE)
    assert d["plan"]["samples_per_s"] == pytest.approx(rows[name]["samples_per_s"])
    code, out = hpar_to_file(tmp_path / "plain.json", "profile", script, *link)
    assert code == 0, out[-3000:]
    d = _last_json(out)
    assert d["plan"]["compress"] == ""
    assert not [c for c in d["candidates"] if " --compress " in c["strategy"] and c["available"]]
    assert [c for c in d["candidates"] if " --compress " in c["strategy"]]  # shown all the same
