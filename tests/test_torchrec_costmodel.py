"""TorchRec's shardings in the cost model (strategies/plan/costmodel_torchrec.py) and the planner:
the all-to-all bytes of a known table set by hand, the rows ``hpar profile`` lists, and
``auto`` choosing TorchRec where it is predicted fastest (pooled bags of many ids over a slow
link) and not otherwise; without the install the rows are not runnable with its one line.
The cost model needs no TorchRec; the CLI checks take the installed or missing branch."""

import json
import os

import pytest

from conftest import REPO, hpar_to_file, write_script

from hpar.strategies.plan.cluster import make_cluster
from hpar.strategies.plan.costmodel_torchrec import (
    estimate_torchrec,
    estimate_torchrec_cw,
    estimate_torchrec_rw,
    estimate_torchrec_tw,
)
from hpar.strategies.plan.planner import choose_plan
from hpar.strategies.profile.records import LayerProfile, ParamProfile, Profile
from hpar.strategies.runtimes.torchrec import trec_check

HAVE_TORCHREC = trec_check.problem(trec_check.versions()) is None
B = 32  # samples per worker


def _profile(bag_ids: int = 8, rows: int = 1000) -> Profile:
    """A bag table (rows x 16, ``bag_ids`` ids per sample, one bag), a lookup table (500 x 8, two
    ids per sample, a row each) and a 100-byte dense head, batch B per worker."""
    bag = ParamProfile("bag.weight", (rows, 16), rows * 16 * 4, True, 0.05, 0.1, True, 0, lookups=B * bag_ids, bags=B)
    one = ParamProfile("one.weight", (500, 8), 500 * 8 * 4, True, 0.1, 0.2, True, 0, lookups=2 * B, bags=2 * B)
    head = ParamProfile("head.weight", (25,), 100, False, 1.0, 1.0, False, 1)
    layers = (LayerProfile("emb", 1e-4, 1e-4, 0, 0, 0), LayerProfile("head", 1e-4, 1e-4, 0, 0, 100))
    return Profile(
        params=(bag, one, head),
        layers=layers,
        batch_size=B,
        samples_per_batch=B,
        workers=4,
        is_sequential=False,
        sequential_reason="",
        compute_s=4e-4,
        forward_s=2e-4,
        backward_s=2e-4,
        forward_flops=0,
        backward_flops=0,
        update_s_per_byte=1e-9,
        timing_batch_size=B,
    )


def test_all_to_all_bytes_and_seconds_by_hand():
    prof = _profile()
    cluster = make_cluster([1, 1, 1, 1], None, None, 1e6, 0.0)  # 4 hosts, a worker each, 1 MB/s, no latency
    n = 4
    # per worker: ids (8-byte ids and 8-byte bag lengths) and pooled rows (bags x dim x 4 bytes)
    ids = {"bag": B * 8 * 8 + B * 8, "one": 2 * B * 8 + 2 * B * 8}  # 2304, 1024
    rows = {"bag": B * 16 * 4, "one": 2 * B * 8 * 4}  # 2048, 2048
    dense = 2 * (n - 1) / n * 100
    tw = sum((n - 1) / n * (ids[t] + 2 * rows[t]) for t in ids) + dense
    # row-wise on gloo (CPU workers): the reduce-scatter moves an AllReduce's bytes, 2 (N-1) x rows
    rw = sum((n - 1) / n * ids[t] + (2 + 1) * (n - 1) * rows[t] for t in ids) + dense
    # column-wise: the 16-wide table cut in 4 shards of 4 columns, each worker's ids to all of
    # them; the 8-wide one cannot be cut in 4 (2 columns, FBGEMM needs 4): kept whole, table-wise
    from hpar.strategies.specs.torchrec_spec import column_shards

    assert (column_shards(16, 4), column_shards(8, 4), column_shards(8, 2), column_shards(16, 8)) == (4, 1, 2, 1)
    assert (column_shards(512, 3), column_shards(384, 5)) == (4, 3)  # TorchRec's 128-column floor
    cw = (n - 1) * ids["bag"] + 2 * (n - 1) / n * rows["bag"] + (n - 1) / n * (ids["one"] + 2 * rows["one"]) + dense
    assert (tw, rw, cw) == (8790, 39510, 13974)
    got = {
        e.strategy: e
        for e in (
            estimate_torchrec_tw(prof, cluster),
            estimate_torchrec_rw(prof, cluster),
            estimate_torchrec_cw(prof, cluster),
        )
    }
    assert got["torchrec-tw"].bytes_per_step == pytest.approx(tw)
    assert got["torchrec-rw"].bytes_per_step == pytest.approx(rw)
    assert got["torchrec-cw"].bytes_per_step == pytest.approx(cw)
    # table-wise: each table's owner link carries its N-1 peers' ids in, its rows out, their gradients in
    a2a = got["torchrec-tw"].breakdown
    assert a2a["all_to_all_ids"] == pytest.approx(3 * (ids["bag"] + ids["one"]) / 1e6)
    assert a2a["all_to_all_rows"] == pytest.approx(3 * (rows["bag"] + rows["one"]) / 1e6)
    assert a2a["all_to_all_grads"] == a2a["all_to_all_rows"] and a2a["all_to_all_fixed"] == 0.0
    # row-wise: every worker sends (N-1) x its rows in a reduce-scatter of partial sums (x 2 on gloo),
    # and as many gradients in an all-gather
    assert got["torchrec-rw"].breakdown["all_to_all_rows"] == pytest.approx(2 * 3 * (rows["bag"] + rows["one"]) / 1e6)
    assert got["torchrec-rw"].breakdown["all_to_all_grads"] == pytest.approx(3 * (rows["bag"] + rows["one"]) / 1e6)
    # the planner's choice is predicted as the cheapest of the three, named in its note
    best = min(got.values(), key=lambda e: e.step_s)
    planner = estimate_torchrec(prof, cluster)
    assert planner.step_s == best.step_s and planner.note.endswith(best.note) and planner.strategy == "torchrec"
    # with latency: 5 collectives per table of N-1 latencies each
    slow = make_cluster([1, 1, 1, 1], None, None, 1e6, 1e-3)
    assert estimate_torchrec_tw(prof, slow).breakdown["all_to_all_fixed"] == pytest.approx(2 * 5 * 3 * 1e-3)


def test_auto_takes_torchrec_where_it_is_predicted_fastest_and_never_without_the_install(monkeypatch):
    heavy = _profile(bag_ids=256, rows=200_000)  # 256 ids per sample pooled into one bag: rows barely repeat
    heavy = Profile(
        **{
            **heavy.__dict__,
            "params": tuple(
                ParamProfile(**{**p.__dict__, "alpha": 0.04, "union_alpha": 0.08}) if p.name == "bag.weight" else p
                for p in heavy.params
            ),
        }
    )
    slow = make_cluster([1, 1], None, None, 1.25e6, 1e-3)  # 2 hosts at 10 Mbit/s
    monkeypatch.setattr(trec_check, "check_available", lambda: None)
    plan = choose_plan(heavy, slow)
    assert plan.strategy.startswith("torchrec"), plan.reason
    assert "TorchRec's all-to-alls send" in plan.reason
    assert "of torchrec." not in plan.reason  # the runner-up named is another plan, not the same one renamed
    light = _profile(bag_ids=1, rows=50)  # a tiny table: its collectives' latencies cost more than its rows
    assert not choose_plan(light, slow).strategy.startswith("torchrec")
    line = "--strategy torchrec needs TorchRec (torchrec not installed): install ..."
    monkeypatch.setattr(trec_check, "check_available", lambda: (_ for _ in ()).throw(ValueError(line)))
    missing = choose_plan(heavy, slow)
    assert not missing.strategy.startswith("torchrec") and "torchrec" not in missing.reason  # not "predicted faster"
    rows = [c for c in missing.candidates if c.strategy.startswith("torchrec")]
    assert len(rows) == 4 and all(not c.available and c.note == line and c.predicted_step_s > 0 for c in rows)


BAGS = """
import torch, torch.nn as nn
HPAR = {"steps": 4, "batch_size": 64, "lr": 0.1}
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(200_000, 32, mode="sum")
        self.head = nn.Linear(32, 1)
    def forward(self, ids):
        return self.head(self.bag(ids)).squeeze(1)
def model():
    return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        ids = torch.randint(0, 200_000, (batch_size, 128), generator=g)
        yield ids, (ids % 2).float().mean(1)
def loss(output, targets):
    return ((output - targets) ** 2).mean()
def optimizer(params):
    return torch.optim.Adagrad(params, lr=0.1)
"""


def _profile_json(tmp_path, script, name, *flags):
    code, out = hpar_to_file(
        tmp_path / f"{name}.out",
        "profile",
        script,
        "--gpus",
        "2",
        "--hosts",
        "2x1",
        "--latency",
        "1ms",
        "--json",
        *flags,
        timeout=120,
    )
    assert code == 0, out
    start = out.index("{") if out.startswith("{") else out.index("\n{") + 1  # stderr's lines may come first
    return json.JSONDecoder().raw_decode(out[start:])[0]


def test_profile_lists_torchrec_rows_and_auto_takes_them_on_slow_links(tmp_path):
    recsys = _profile_json(tmp_path, os.path.join(REPO, "examples", "recsys.py"), "recsys", "--bandwidth", "10gbit")
    rows = {c["strategy"]: c for c in recsys["candidates"] if c["strategy"].startswith("torchrec")}
    assert set(rows) == {"torchrec", "torchrec-tw", "torchrec-rw", "torchrec-cw"}
    assert all(c["predicted_step_s"] > 0 and c["bytes_per_step"] > 0 for c in rows.values())
    # bytes by hand from the profile's lookups: the history bag pools 8 ids per sample, the others look up one
    tables = [p for p in recsys["parameters"] if p["embedding_module"]]
    assert {p["name"]: (p["lookups"], p["bags"]) for p in tables} == {
        "user.weight": (256, 256),
        "item.weight": (256, 256),
        "category.weight": (256, 256),
        "history.weight": (2048, 256),
    }
    dense = sum(p["bytes"] for p in recsys["parameters"] if not p["embedding_module"])
    tw = sum(0.5 * (p["lookups"] * 8 + p["bags"] * 8 + 2 * p["bags"] * p["shape"][1] * 4) for p in tables) + dense
    assert rows["torchrec-tw"]["bytes_per_step"] == pytest.approx(tw)
    assert not recsys["plan"]["strategy"].startswith("torchrec")  # 10 Gbit/s: the touched rows cost less
    bags = _profile_json(tmp_path, write_script(tmp_path, BAGS, "bags.py"), "bags", "--bandwidth", "10mbit")
    picked = bags["plan"]["strategy"]
    mine = {c["strategy"]: c for c in bags["candidates"]}
    if HAVE_TORCHREC:  # 128 ids pooled per sample on 10 Mbit/s: pooled rows, not 8,192 touched rows a step
        assert picked.startswith("torchrec"), bags["plan"]["reason"]
        assert mine[picked]["bytes_per_step"] < mine["hybrid"]["bytes_per_step"] / 10
    else:
        assert not picked.startswith("torchrec")
        assert all(not mine[s]["available"] and "needs TorchRec" in mine[s]["note"] for s in rows)


def test_auto_leaves_out_what_the_runs_settings_refuse():
    from hpar.strategies.plan.vet import unsettled

    bf16 = (("precision", "bf16"), ("clip_grad_norm", 0.0), ("accumulate", 1))
    assert unsettled("torchrec-tw", bf16).startswith("--precision bf16 is not supported with --strategy torchrec-tw")
    assert "--clip-grad-norm" in unsettled("torchrec", (("precision", "fp32"), ("clip_grad_norm", 1.0)))
    assert unsettled("torchrec-rw", (("precision", "fp32"), ("clip_grad_norm", 0.0), ("accumulate", 1))) == ""
    assert unsettled("hybrid", bf16) == "" and unsettled("torchrec", ()) == ""


def test_a_table_fbgemm_cannot_hold_makes_every_torchrec_row_infeasible():
    from torch import nn

    from hpar.strategies.runtimes.torchrec.trec_tables import table_problem

    prof = _profile()
    bias = ParamProfile("bias.weight", (500, 1), 500 * 4, True, 0.1, 0.2, True, 0, lookups=B, bags=B)
    narrow = Profile(**{**prof.__dict__, "params": prof.params + (bias,)})
    cluster = make_cluster([2], None, None, 1e9, 1e-5)
    for est in (estimate_torchrec, estimate_torchrec_tw, estimate_torchrec_rw, estimate_torchrec_cw):
        e = est(narrow, cluster)
        assert not e.feasible and e.note.startswith("bias.weight is not a multiple of 4 columns wide")
    # what hpar run refuses before start, in one line (lm.py's per-word softmax bias)
    line = table_problem("softmax_b", nn.Embedding(10, 1), False)
    assert line == (
        "--strategy torchrec: softmax_b is 1 columns wide; FBGEMM's table kernels need a multiple of 4: "
        "widen it or use another strategy"
    )
