"""Fine-tuning with frozen layers through the real `hpar run` (issue 67, item 1): a Hugging Face
Llama built from a config (tests/zoo/hf_llama_frozen.py) whose token embedding and first
decoder block have ``requires_grad=False``, its ``optimizer()`` given only the trainable
parameters, as fine-tuning scripts write it.

Every data-parallel strategy trains it equal to one process on the concatenated batches, the
frozen tensors bit-identical to their initial values (a frozen table is never served: ``ps``
keeps it on the workers); a pipeline whose stage 0 holds only frozen layers (no optimizer
there) trains at 2 and 4 stages equal to one process; ``auto`` runs what it chose. And the
planner (``hpar profile``'s and ``auto``'s) lists as not runnable a candidate that `hpar run`
would refuse before start, with the refusal's line (strategies/plan/vet.py).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from conftest import final_state, single_process_reference, write_script
from test_zoo import ZOO, check_trained, hpar_run

pytestmark = pytest.mark.multiprocess
needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed (pip install -e '.[hf]')"
)
NAME, STEPS, BATCH, LR = "hf_llama_frozen", 4, 8, 0.05
SCRIPT = os.path.join(ZOO, f"{NAME}.py")


_INITIAL: dict = {}


def _initial() -> tuple[dict, set]:
    """The model's state_dict as ``model()`` builds it under the run's seed (0), and the names
    of its frozen parameters (once)."""
    if not _INITIAL:
        from hpar.strategies.job.contract import load_job

        torch.manual_seed(0)
        model = load_job(SCRIPT).build_model()
        _INITIAL["state"] = {k: v.clone() for k, v in model.state_dict().items()}
        _INITIAL["frozen"] = {n for n, p in model.named_parameters() if not p.requires_grad}
    return _INITIAL["state"], _INITIAL["frozen"]


def _check_against_one_process(r: dict, world_size: int) -> None:
    """The run's saved model equals one process trained on the ``world_size`` ranks'
    concatenated batches; its frozen tensors are bitwise their initial values."""
    check_trained(r)
    got = final_state(r["run_dir"])
    ref = single_process_reference(SCRIPT, world_size, STEPS, BATCH, LR)
    assert got.keys() == ref.keys()
    initial, frozen = _initial()
    assert "model.embed_tokens.weight" in frozen and any(".layers.0." in n for n in frozen)
    for k in ref:
        if k in frozen:
            assert torch.equal(got[k], initial[k]), k
        else:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5, msg=k)
    assert not torch.equal(got["lm_head.weight"], initial["lm_head.weight"])  # the rest did train


@needs_hf
@pytest.mark.parametrize("strategy", ["allreduce", "hybrid", "ps", "fsdp"])
def test_frozen_llama_under_data_parallel_equals_one_process(tmp_path_factory, strategy):
    """2 workers: hybrid runs as allreduce (its one table is frozen: nothing to serve, said in
    one line), ps serves every trainable parameter and keeps the frozen ones on the workers."""
    r = hpar_run(tmp_path_factory, NAME, strategy, 2)
    _check_against_one_process(r, 2)
    if strategy == "hybrid":
        assert "no trainable embedding table" in r["out"], r["out"][-2000:]
    if strategy == "ps":
        served = r["summary"].get("ps_params") or []
        assert "model.embed_tokens.weight" not in served and not any(".layers.0." in n for n in served), served


@needs_hf
@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_whose_first_stage_is_frozen_equals_one_process(tmp_path_factory, stages):
    """Stage 0 holds the embedding and the first block, all frozen (layers 0 and 1 of the
    traced model): it gets no optimizer, still sends activations, and the run equals one process."""
    plan = tmp_path_factory.mktemp("plan") / f"plan{stages}.json"
    cuts = {2: [[0, 2], [2, 6]], 4: [[0, 2], [2, 3], [3, 4], [4, 6]]}[stages]
    plan.write_text(json.dumps({"strategy": "pipeline", "stages": cuts, "micro_batches": 2}))
    r = hpar_run(tmp_path_factory, NAME, "pipeline", stages, "--plan", str(plan), "--schedule", "1f1b")
    assert f"{stages} stages" in r["out"] and "layers [0, 2)" in r["out"], r["out"][-2000:]
    _check_against_one_process(r, 1)


@needs_hf
def test_auto_runs_its_own_choice(tmp_path_factory):
    """`--strategy auto` exits 0 with the strategy it chose, frozen tensors untouched."""
    r = hpar_run(tmp_path_factory, NAME, "auto", 2, "--tune", "off")
    check_trained(r)
    assert "--strategy auto chose" in r["out"], r["out"][-2000:]
    got, (initial, frozen) = final_state(r["run_dir"]), _initial()
    for k in frozen:
        assert torch.equal(got[k], initial[k]), k


LEFT_OUT = """
import torch, torch.nn as nn, torch.nn.functional as F
HPAR = {"steps": 2, "batch_size": 16}
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(500, 8), nn.Linear(8, 1)
    def forward(self, x):
        return self.head(self.emb(x).mean(1))
def model(): return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        x = torch.randint(0, 500, (batch_size, 4), generator=g)
        yield x, (x % 7).float().mean(1, keepdim=True)
def loss(o, t): return F.mse_loss(o, t)
def optimizer(params):   # trains the head only, the table left out though it is trainable
    return torch.optim.SGD([p for p in params if p.dim() == 2 and p.shape[0] == 1], lr=0.1)
"""


def test_planner_never_offers_what_run_refuses(tmp_path):
    """A trainable embedding table left out of optimizer(): `hpar run --strategy hybrid/ps`
    refuses it (a served parameter in no param group), so the vetted plan lists hybrid and
    ps as not runnable with that line, and chooses something else; the planner alone would
    have offered them."""
    from hpar.launcher.run.cluster_build import build_cluster
    from hpar.strategies.plan.vet import vetted_plan
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.plan.planner import choose_plan
    from hpar.strategies.profile.profiler import profile_job

    job = load_job(write_script(tmp_path, LEFT_OUT))
    profile = profile_job(job, 16, 2, repeats=1, warmup=1)
    cluster = build_cluster(2, None, None, "10Gbps", "50us", None)
    plain = {c.strategy: c for c in choose_plan(profile, cluster).candidates}
    assert plain["ps"].available, plain["ps"]  # what the planner would offer without the checks
    plan = vetted_plan(job, profile, cluster)
    vetted = {c.strategy: c for c in plan.candidates}
    for name in ("hybrid", "ps"):
        if plain[name].available:
            assert not vetted[name].available and "emb.weight is in no param group" in vetted[name].note, vetted[name]
    assert plan.strategy not in ("hybrid", "ps"), plan.strategy
