"""DDP's find_unused_parameters (strategies/runtimes/dataparallel/ddp.py, strategies/profile/unused.py): which
parameters a profiled step left without a gradient, the decision, and DDP's error turned into
one line. The runs through `hpar run` are in tests/test_zoo.py (they reuse the zoo's runs)."""

from __future__ import annotations

import os
import types

import pytest
import torch
from torch import nn

from conftest import REPO
from hpar.strategies.runtimes.dataparallel.ddp import reducer_names, unused_message
from hpar.strategies.job.config import find_unused
from hpar.strategies.job.contract import load_job
from hpar.strategies.profile.profiler import profile_job
from hpar.strategies.profile.unused import missing_gradients, unused_parameters

ZOO = os.path.join(REPO, "tests", "zoo")
BRANCH = ("extra.bias", "extra.weight")  # sometimes_unused.py skips its extra layer every other step


def test_probe_sees_a_branch_skipped_every_other_step():
    job = load_job(os.path.join(ZOO, "sometimes_unused.py"))
    assert unused_parameters(job, 8, 2) == BRANCH
    assert unused_parameters(job, 8, 2, steps=1) == ()  # the first batch takes the branch
    assert unused_parameters(job, 8, 2, budget_s=0.0) == BRANCH  # past its time budget it still runs 2 steps


def test_probe_leaves_out_frozen_parameters_and_finds_none_in_a_plain_model():
    job = load_job(os.path.join(ZOO, "frozen.py"))  # frozen parameters never get a gradient: DDP skips them too
    assert unused_parameters(job, 8, 2) == ()
    assert unused_parameters(load_job(os.path.join(ZOO, "tuple_out.py")), 8, 2) == ()


def test_profile_records_unused_parameters():
    """The profiler's own steps (here 1 warm-up and 1 timed) record them; the planner's plan
    carries them to `hpar run`."""
    job = load_job(os.path.join(ZOO, "sometimes_unused.py"))
    profile = profile_job(job, 8, 2, repeats=1, warmup=1)
    assert profile.unused_params == BRANCH
    assert type(profile).from_dict(profile.to_dict()).unused_params == BRANCH
    assert profile_job(load_job(os.path.join(ZOO, "tuple_out.py")), 8, 2, repeats=1, warmup=1).unused_params == ()


def test_missing_gradients_after_a_backward():
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2), "frozen": nn.Linear(2, 2)})
    model["frozen"].requires_grad_(False)
    model["a"](torch.ones(1, 2)).sum().backward()
    assert missing_gradients(model) == {"b.weight", "b.bias"}


def test_decision():
    assert find_unused("auto", ["extra.weight"]) is True
    assert find_unused("auto", []) is False
    assert find_unused("auto", ["emb.weight"], ignored=["emb.weight"]) is False  # a served table: DDP ignores it
    assert find_unused("on", []) is True and find_unused("off", ["x"]) is False
    with pytest.raises(ValueError, match="--find-unused-parameters 'yes'"):
        find_unused("yes", [])


def test_ddp_error_becomes_one_line_naming_the_parameters_and_the_flag():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    ddp = types.SimpleNamespace(module=model, parameters_to_ignore={"1.bias"})
    names = reducer_names(ddp)
    assert names == ["0.bias", "1.weight"]  # DDP's reducer order: trainable, not ignored
    text = (
        "Expected to have finished reduction in the prior iteration before starting a new one. ...\n"
        "Parameter indices which did not receive grad for rank 1: 1\n In addition, ..."
    )
    line = unused_message(text, names)
    assert (
        "\n" not in line and "(1.weight on worker 1)" in line and line.endswith("run with --find-unused-parameters on")
    )
    assert unused_message("some other DDP error", names) is None


def test_probe_on_the_checked_model_leaves_it_as_it_was():
    """`hpar run` probes the model its pre-start check built: gradients cleared, sparse= flags
    and train/eval mode restored."""
    job = load_job(os.path.join(ZOO, "tied_lm.py"))
    model = job.build_model().eval()
    assert unused_parameters(job, 8, 2, model=model) == ()
    assert not model.training and not model.emb.sparse and not model.doc.sparse
    assert all(p.grad is None for p in model.parameters())
