"""Defects found with everyday models (issue 14), each checked through the real `hpar`
command with stdout and stderr to a file: user exceptions in the pre-start check, a missing
optional package, a pipeline plan that cannot run, the planner's printed choice; plus the one
definition of the model's layers (``hpar_layers()``) in the pipeline's stages."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hpar.strategies.specs.decision import Plan
from conftest import REPO, TINY, hpar_to_file, run_processes, single_process_reference, write_script

RAISES_IN_FORWARD = """
import torch, torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
    def forward(self, x):
        return self.fc(x.view(3, 7))          # wrong shape: raises on the first batch
def model(): return Net()
def data(rank, world_size, batch_size):
    while True:
        yield torch.randn(batch_size, 4), torch.randn(batch_size, 1)
def loss(o, t): return ((o - t) ** 2).mean()
"""

# Passes the pre-start check (one forward pass) and fails later, as a forward that makes a
# tensor on the CPU fails only once the profile runs it on a GPU.
RAISES_WHILE_PROFILING = """
import torch, torch.nn as nn
CALLS = [0]
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
    def forward(self, x):
        CALLS[0] += 1
        if CALLS[0] > 2:
            raise RuntimeError("Expected all tensors to be on the same device")
        return self.fc(x)
def model(): return Net()
def data(rank, world_size, batch_size):
    while True:
        yield torch.randn(batch_size, 4), torch.randn(batch_size, 1)
def loss(o, t): return ((o - t) ** 2).mean()
"""

# Blocks of layers (each an nn.Sequential): 3 layers at the top level, 8 modules flattened.
NESTED = """
import torch, torch.nn as nn
HPAR = {"steps": 4, "batch_size": 8, "lr": 0.1}
def model():
    return nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.Tanh()),
                         nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()),
                         nn.Sequential(nn.Linear(8, 1), nn.Identity()))
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        x = torch.randn(batch_size, 4, generator=g)
        yield x, x.sum(1, keepdim=True)
def loss(o, t): return ((o - t) ** 2).mean()
"""

# A model that is not an nn.Sequential and names its layers with hpar_layers().
WITH_HPAR_LAYERS = """
import torch, torch.nn as nn
HPAR = {"steps": 5, "batch_size": 8, "lr": 0.1}
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 1)
    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)
    def hpar_layers(self):
        return nn.Sequential(self.stem, *self.blocks, self.head)
def model(): return Net()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        x = torch.randn(batch_size, 4, generator=g)
        yield x, x.sum(1, keepdim=True)
def loss(o, t): return ((o - t) ** 2).mean()
"""


def run_cli(tmp_path, *args, env=None) -> tuple[int, str]:
    """`hpar ARGS` with stdout and stderr to a file (as a batch job): (exit code, output)."""
    return hpar_to_file(tmp_path / "out.txt", *args, cwd=str(tmp_path), env=env)


def test_exception_in_users_forward_is_theirs(tmp_path):
    script = write_script(tmp_path, RAISES_IN_FORWARD)
    run_dir = tmp_path / "run"
    rc, out = run_cli(tmp_path, "run", script, "--gpus", "2", "--run-dir", str(run_dir))
    assert rc == 2, out
    first = out.splitlines()[0]
    assert first.startswith(f"hpar: {script}:8: forward() raised RuntimeError: shape '[3, 7]'"), out
    assert f'File "{script}", line 8, in forward' in out and "launcher" not in out, out  # their traceback only
    assert not run_dir.exists() and not run_processes(str(run_dir))  # nothing started
    rc, out = run_cli(tmp_path, "profile", script, "--bandwidth", "10Gbps", "--latency", "50us")
    assert rc == 2 and out.splitlines()[0] == first, out


def test_missing_optional_package_of_an_example(tmp_path):
    """examples/cnn.py without scikit-learn (a package on the path that is missing, as
    Python reports it) is one line naming the script, the function and the fix."""
    fake = tmp_path / "nosklearn" / "sklearn"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'sklearn'\", name='sklearn')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "run"
    rc, out = run_cli(
        tmp_path, "run", os.path.join(REPO, "examples", "cnn.py"), "--gpus", "2", "--run-dir", str(run_dir), env=env
    )
    assert rc == 2, out
    first = out.splitlines()[0]
    assert first.startswith("hpar: " + os.path.join(REPO, "examples", "cnn.py") + ":"), out
    assert (
        "digits() raised ModuleNotFoundError while producing a batch in data(): No module named 'sklearn'" in first
    ), out
    assert "Traceback" in out and 'cnn.py", line' in out and "launcher" not in out, out
    assert "pip install -e '.[examples]'" in first, out
    assert not run_dir.exists()


def test_pipeline_plan_that_cannot_run_is_refused_before_start(tmp_path):
    """A plan cut at flattened leaves (8) of a model whose layers are its 3 blocks."""
    script = write_script(tmp_path, NESTED)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"strategy": "pipeline", "stages": [[0, 4], [4, 8]], "micro_batches": 2}))
    run_dir = tmp_path / "run"
    rc, out = run_cli(tmp_path, "run", script, "--gpus", "2", "--plan", str(plan), "--run-dir", str(run_dir))
    assert rc == 2, out
    assert out.splitlines()[-1].startswith(
        f"hpar: {plan}: plan stages [(0, 4), (4, 8)] do not split the model's 3 layers"
    ), out
    assert not (run_dir / "config.json").exists() and not run_processes(str(run_dir))


def test_nested_blocks_pipeline_runs_through_the_planner(tmp_path, reap_run):
    """The profile and planner cut the same 3 layers the stages run."""
    script = write_script(tmp_path, NESTED)
    run_dir = tmp_path / "run"
    reap_run(str(run_dir))
    rc, out = run_cli(
        tmp_path,
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "pipeline",
        "--schedule",
        "gpipe",
        "--micro-batches",
        "2",
        "--run-dir",
        str(run_dir),
        "--no-eval",
    )
    assert rc == 0, out
    assert (
        "hpar: pipeline plan: 2 stages, layers [0, 1), [1, 3)" in out
        or "hpar: pipeline plan: 2 stages, layers [0, 2), [2, 3)" in out
    ), out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stage_layers"][-1]["layers"][1] == 3


def test_auto_prints_its_choice_once(tmp_path):
    """`--strategy auto` on a dense model: allreduce (never a hybrid with nothing on its
    servers), its name printed once; the profile's plan line likewise."""
    script = write_script(tmp_path, TINY)
    rc, out = run_cli(tmp_path, "profile", script, "--gpus", "2", "--bandwidth", "10Gbps", "--latency", "50us")
    assert rc == 0, out
    plan_line = next(line for line in out.splitlines() if line.startswith("Plan:"))
    assert plan_line.startswith("Plan: allreduce: ") and plan_line.count("allreduce:") == 1, plan_line


def test_hpar_layers_pipeline_equals_single_process(tmp_path):
    """A model that is not an nn.Sequential but names its layers with hpar_layers(): the
    profile counts them, the stages (state_dict keys as in the whole model) run them, and a
    synchronous pipeline equals single-process training."""
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.job.layers import model_layers
    from hpar.strategies.runtimes.pipeline.sim import simulate
    from hpar.strategies.profile.layer_timing import pipeline_layers

    script = write_script(tmp_path, WITH_HPAR_LAYERS)
    job = load_job(script)
    model = job.build_model()
    names = [n for n, _ in model_layers(model)]
    assert names == ["stem", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert [n for n, _ in pipeline_layers(model)[0]] == names
    sim = simulate(job, "gpipe", 3, steps=5, batch_size=8, micro_batches=2, lr=0.1, seed=0)
    ref = single_process_reference(script, 1, 5, 8, 0.1, seed=0)
    got = sim.model.state_dict()
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


def test_hpar_layers_must_cover_the_model():
    from hpar.strategies.job.layers import model_layers

    class Partial(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

        def hpar_layers(self):
            return torch.nn.Sequential(self.a)

    with pytest.raises(ValueError, match="leaves parameter 'b.weight' outside every layer"):
        model_layers(Partial())
    with pytest.raises(ValueError, match="not a submodule"):
        model_layers(type("Foreign", (Partial,), {"hpar_layers": lambda self: [torch.nn.Linear(2, 2)]})())


def test_tied_weight_is_one_dense_parameter():
    """The zoo's tied LM: the embedding tied to the output Linear is profiled dense and kept
    off the servers; the untied document table stays a row-sparse embedding."""
    from hpar.strategies.plan.placement import placement
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.profile.profiler import profile_job
    from hpar.strategies.job.tying import embedding_tables, shared_parameters

    job = load_job(os.path.join(REPO, "tests", "zoo", "tied_lm.py"))
    model = job.build_model()
    assert shared_parameters(model) == {"emb.weight": ["emb.weight", "out.weight"]}
    assert [n for n, _ in embedding_tables(model)] == ["doc"]
    prof = {p.name: p for p in profile_job(job, 8, 2, repeats=1, warmup=1).params}
    assert not prof["emb.weight"].sparse and not prof["emb.weight"].embedding_module
    assert prof["doc.weight"].sparse and prof["doc.weight"].embedding_module
    assert placement(model, "hybrid", Plan()) == {
        "emb.weight": "allreduce",
        "doc.weight": "ps",
        "mix.weight": "allreduce",
        "mix.bias": "allreduce",
    }
    with pytest.raises(ValueError, match="tied to a dense user"):
        placement(model, "hybrid", Plan(placement={"emb.weight": "ps"}))


def test_atomic_files_get_the_same_permissions_as_plain_ones(tmp_path):
    from hpar.strategies.state.checkpoint import atomic_write_bytes

    atomic_write_bytes(str(tmp_path / "summary.json"), b"{}")
    (tmp_path / "worker-0.log").write_text("")
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == (tmp_path / "worker-0.log").stat().st_mode & 0o777


def test_live_view_final_state_has_no_running_row():
    """After Ctrl-C (or a failure elsewhere) the rows of processes that were still running
    read 'stopped' in the table the live view leaves on the screen."""
    import io
    from rich.console import Console
    from hpar.launcher.run.progress import Progress

    buf = io.StringIO()
    with Progress(
        [("worker 0", "localhost"), ("worker 1", "localhost")],
        10,
        live=True,
        console=Console(file=buf, force_terminal=True, width=160),
    ) as progress:
        progress.update("worker 0", "metric", {"step": 3, "loss": 0.5, "samples_per_s": 10.0})
        progress.update("worker 1", "state", {"state": "done"})
        progress.mark_stopped()
    final = buf.getvalue().rsplit("hpar: 10 steps", 1)[-1]
    assert "stopped" in final and "running" not in final and "done" in final


def test_samples_per_s_is_samples_over_the_wall_clock_of_the_measured_window():
    """Time between steps (data loading, waiting) counts: 4 measured steps of 8 samples with
    at least 50 ms outside every step give at most 8 / 0.05 samples/s, however short the steps
    themselves (a median step time would report far more). The final line's losses are
    interval means."""
    import time
    from types import SimpleNamespace
    from hpar.strategies.job.context import StepMeter

    reports = []
    ctx = SimpleNamespace(
        cfg=SimpleNamespace(log_every=3, steps=6), start_step=0, report=reports.append, on_step=None, event=None, rank=0
    )
    meter = StepMeter(ctx, samples_per_step=8, warmup=2)
    for loss in (6.0, 5.0, 4.0, 3.0, 2.0, 1.0):
        meter.start()
        meter.end(loss)
        time.sleep(0.05)
    assert 0 < meter.samples_per_s() <= 8 / 0.05
    assert 8 / min(meter.step_times[2:]) > 8 / 0.05  # what a per-step figure would have claimed
    got = meter.result(None).extra
    assert got["loss_first_mean"] == 5.0 and got["loss_last_mean"] == 2.0 and got["loss_mean_steps"] == [3, 3]
    assert [r["loss"] for r in reports] == [5.0, 2.0]  # the progress lines' averaging


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores for hpar's own thread count to differ from 1")
def test_exported_omp_num_threads_sets_the_workers_threads(tmp_path, reap_run):
    """`OMP_NUM_THREADS=1 hpar run ...` (exported, as in a batch script): the worker runs 1 CPU
    thread (its heartbeats say so); without it, hpar gives a lone worker every core."""
    script = write_script(tmp_path, TINY)
    threads = {}
    for name, value in (("exported", "1"), ("default", None)):
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | (
            {"OMP_NUM_THREADS": value} if value else {}
        )
        run_dir = tmp_path / name
        reap_run(str(run_dir))
        rc, out = run_cli(
            tmp_path,
            "run",
            script,
            "--gpus",
            "1",
            "--strategy",
            "allreduce",
            "--steps",
            "3",
            "--no-eval",
            "--plain",
            "--run-dir",
            str(run_dir),
            env=env,
        )
        assert rc == 0, out
        beats = [
            json.loads(line.split(" ", 2)[2])
            for line in (run_dir / "logs" / "worker-0.log").read_text().splitlines()
            if line.startswith("@hpar heartbeat ")
        ]
        threads[name] = {b["threads"] for b in beats}
    assert threads == {"exported": {1}, "default": {os.cpu_count()}}, threads


def test_exception_in_users_forward_while_profiling_is_theirs(tmp_path):
    """A forward that passes the pre-start check and fails while `hpar profile` times it (as one
    that makes a tensor on the CPU fails only on a GPU): one line naming their file, line and
    function and where it ran, their traceback after it, exit 2."""
    script = write_script(tmp_path, RAISES_WHILE_PROFILING)
    rc, out = run_cli(tmp_path, "profile", script, "--gpus", "1", "--device", "cpu")
    assert rc == 2, out
    first = out.splitlines()[0]
    assert first == (
        f"hpar: {script}:11: forward() raised RuntimeError: Expected all tensors to be on the same "
        "device (while profiling on cpu)"
    ), out
    assert f'File "{script}", line 11, in forward' in out and "launcher" not in out, out


def test_pipeline_on_three_workers_chooses_micro_batches_that_divide_the_batch(tmp_path, reap_run):
    """examples/cnn.py (BatchNorm blocks, batch 32) as a 3-stage pipeline with no
    --micro-batches: the planner's M divides the batch (it tried 3, 6 and 12 before, and `hpar
    run` refused its own choice of 3)."""
    run_dir = tmp_path / "run"
    reap_run(str(run_dir))
    rc, out = run_cli(
        tmp_path,
        "run",
        os.path.join(REPO, "examples", "cnn.py"),
        "--gpus",
        "3",
        "--strategy",
        "pipeline",
        "--steps",
        "2",
        "--log-every",
        "1",
        "--run-dir",
        str(run_dir),
        "--no-eval",
    )
    assert rc == 0, out
    line = next(l for l in out.splitlines() if l.startswith("hpar: pipeline plan: 3 stages"))
    micro = int(line.split(" micro-batch")[0].rsplit(" ", 1)[1])
    assert micro in (1, 2, 4, 8, 16, 32), line
    assert json.loads((run_dir / "config.json").read_text())["micro_batches"] == micro


def test_default_micro_batches_divide_the_batch():
    """Without --micro-batches or HPAR's: the plan's M (a plan file made for another batch size
    moves, saying so), else 4, each moved to the nearest divisor of at least the stages."""
    from hpar.strategies.plan.strategy_settings import default_micro_batches

    said: list[str] = []
    assert default_micro_batches(said.append, Plan(strategy="pipeline", micro_batches=8), 32, 3) == 8 and not said
    assert default_micro_batches(said.append, Plan(strategy="pipeline", micro_batches=3), 32, 3) == 4
    assert said == ["hpar: the plan's 3 micro-batches do not divide --batch-size 32; using 4"]
    assert default_micro_batches(said.append, Plan(strategy="pipeline"), 30, 2) == 5  # 3 and 5 tie: the larger
    assert default_micro_batches(said.append, Plan(strategy="pipeline"), 32, 2) == 4
