"""The strategy registry (strategies/specs/): what each strategy is lives in one spec; nothing
outside compares strategy names; and a strategy added from outside (one module, one entry
point: tests/support/local_strategy.py) runs through the real ``hpar profile`` and ``hpar
run`` like the built-in ones."""

import ast
import json
import os
import shutil

import pytest

from conftest import hpar_to_file, final_state, kill_left, single_process_reference, write_script
from test_allreduce import assert_close_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_specs_say_what_each_strategy_needs():
    from hpar.strategies.specs import registry

    assert registry.names() == (
        "allreduce",
        "allreduce-sparse",
        "hybrid",
        "ps",
        "pipeline",
        "fsdp",
        "torchrec",
        "torchrec-tw",
        "torchrec-rw",
        "torchrec-cw",
    )
    assert registry.where(servers=True) == ("hybrid", "ps")
    assert registry.where(ddp=True) == (
        "allreduce",
        "allreduce-sparse",
        "hybrid",
        "torchrec",
        "torchrec-tw",
        "torchrec-rw",
        "torchrec-cw",
    )
    assert registry.where(pipelined=True) == ("pipeline",)
    assert registry.spec("hybrid-cache").runs_as == "hybrid" and "hybrid-cache" not in registry.names()
    with pytest.raises(ValueError, match="choose one of allreduce, allreduce-sparse"):
        registry.spec("horovod")
    for s in registry.strategies():  # every reference loads
        assert callable(s.load("runtime")) and callable(s.load("worker_memory"))
        assert s.estimate is None or callable(s.load("estimate"))


def _name_comparisons(path: str, names: set[str]) -> list[str]:
    """``file:line`` of every comparison (==, !=, in, not in) against a strategy name's literal."""
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if any(isinstance(i, ast.Constant) and i.value in names for i in items):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    return found


def test_no_strategy_name_is_compared_outside_the_registry():
    from hpar.strategies.specs.registry import CANDIDATES_ONLY, names

    strategy_names = set(names()) | {s.name for s in CANDIDATES_ONLY}
    found = []
    for top in ("launcher", "strategies", "workers"):
        for root, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and not (top == "strategies" and d == "specs")]
            found += [
                hit
                for f in files
                if f.endswith(".py")
                for hit in _name_comparisons(os.path.join(root, f), strategy_names)
            ]
    assert not found, f"strategy names compared outside strategies/specs/ (ask the spec instead): {found}"


TOY = """
import torch
from torch import nn
HPAR = {"steps": 6, "batch_size": 8, "lr": 0.1}
def model():
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(100 + rank)
    while True:
        x = torch.randn(batch_size, 4, generator=g)
        yield x, x.sum(1, keepdim=True)
def loss(output, targets):
    return ((output - targets) ** 2).mean()
def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
"""


@pytest.fixture
def plugin_env(tmp_path):
    """PYTHONPATH with the toy strategy's module and a dist-info folder naming it in the
    ``hpar.strategies`` entry-point group, as ``pip install`` of a plugin would leave them."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "support", "local_strategy.py"), site / "hpar_local_strategy.py")
    info = site / "hpar_local_strategy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hpar-local-strategy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[hpar.strategies]\nlocal = hpar_local_strategy:LOCAL\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_strategy_added_by_entry_point_profiles_and_runs(tmp_path, plugin_env):
    script = write_script(tmp_path, TOY)
    code, out = hpar_to_file(tmp_path / "profile.out", "profile", script, "--gpus", "1", "--json", env=plugin_env)
    assert code == 0, out
    report = json.loads(out[out.index("{") :])
    local = {c["strategy"]: c for c in report["candidates"]}["local"]
    assert local["available"] and local["predicted_step_s"] > 0, local  # planned beside the built-in ones
    run_dir = tmp_path / "run"
    code, out = hpar_to_file(
        tmp_path / "run.out",
        "run",
        script,
        "--gpus",
        "1",
        "--strategy",
        "local",
        "--run-dir",
        str(run_dir),
        "--plain",
        "--no-eval",
        env=plugin_env,
    )
    left = kill_left(run_dir)
    assert code == 0 and not left, out
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["strategy"] == "local" and summary["steps"] == 6
    assert_close_state(final_state(run_dir), single_process_reference(script, 1, 6, 8, 0.1, 0))
    # without the plugin the name is refused in one line, exit 2
    code, out = hpar_to_file(
        tmp_path / "refused.out", "run", script, "--strategy", "local", "--run-dir", str(tmp_path / "r2")
    )
    assert code == 2 and "local" in out and not (tmp_path / "r2").exists(), out
