"""The training loop users expect (LR schedule, clipping, accumulation, mixed precision,
evaluation during training, the log() hook, TensorBoard), through the real `hpar run`, and
exact against one process on the concatenated batches."""

import json
import os
import warnings

import pytest
import torch

from hpar.strategies.job.config import RunConfig
from hpar.strategies.job.contract import JobError, load_job
from hpar.strategies.job.loop import step_schedule, step_tools

from conftest import _concat, hpar, hpar_to_file, kill_left, write_script, final_state

LOOP = """
import torch, torch.nn as nn
HPAR = {"steps": 20, "batch_size": 8, "lr": 0.1, "log_every": 5}
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    def forward(self, x):
        return self.body(x)
def model():
    return nn.Sequential(Block(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(10_000):
        x = torch.randn(batch_size, 4, generator=g)
        yield x, x.sum(1, keepdim=True)
def loss(output, targets):
    return ((output - targets) ** 2).mean()
def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)
def scheduler(opt):   # linear warm-up over 5 steps, then halve every 10
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 ** (s // 10))
def log(step, output, targets):
    return {"abs_err": (output - targets).abs().mean()}
def evaluate(model):
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(7))
    return {"mse": float(((model(x) - x.sum(1, keepdim=True)) ** 2).mean())}
"""


def reference(
    script: str,
    world_size: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    accumulate: int = 1,
    clip: float = 0.0,
) -> tuple[dict, list[float]]:
    """One process, each optimizer step on the concatenation of every rank's ``accumulate``
    batches (mean loss), clipped by the global norm, then the script's schedule stepped:
    what N synchronous workers with ``--accumulate`` and ``--clip-grad-norm`` must equal.
    Returns (state_dict, the loss of every step)."""
    job = load_job(script)
    torch.manual_seed(seed)
    model = job.build_model()
    opt = job.build_optimizer(model.parameters(), lr)
    sched = job.build_scheduler(opt)
    streams = [job.batches(r, world_size, batch_size) for r in range(world_size)]
    losses = []
    for _ in range(steps):
        pairs = [[next(s) for s in streams] for _ in range(accumulate)]
        pairs = [p for micro in pairs for p in micro]
        opt.zero_grad()
        loss = job.compute_loss(model(_concat([p[0] for p in pairs])), _concat([p[1] for p in pairs]))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def run_cli(tmp_path, script: str, *args: str, name: str = "run") -> tuple[int, str, str]:
    """``hpar run SCRIPT ARGS`` with stdout and stderr to a file, as in a batch job; returns
    (exit code, run dir, the output). Fails the test if a process of the run is left."""
    run_dir = str(tmp_path / name)
    code, out = hpar_to_file(tmp_path / f"{name}.out", "run", script, "--run-dir", run_dir, *args)
    assert not kill_left(run_dir), "processes left behind"
    return code, run_dir, out


def close(got: dict, want: dict, rtol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for k in want:
        scale = max(want[k].abs().max().item(), 1e-12)
        assert (got[k] - want[k]).abs().max().item() / scale < rtol, k


def worker0_losses(run_dir: str) -> dict[int, float]:
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {m["step"]: m["loss"] for m in rows if m["kind"] == "metric" and m["rank"] == 0}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_schedule_clipping_accumulation_match_one_process(tmp_path):
    """2 workers x 2 micro-steps with a warm-up schedule and clipping = one process on the
    4 concatenated batches, every weight within 1e-5 after 20 steps; eval during training,
    log() metrics and the TensorBoard file come with it."""
    script = write_script(tmp_path, LOOP)
    code, run_dir, out = run_cli(
        tmp_path,
        script,
        "--gpus",
        "2",
        "--strategy",
        "allreduce",
        "--seed",
        "3",
        "--accumulate",
        "2",
        "--clip-grad-norm",
        "0.5",
        "--eval-every",
        "5",
    )
    assert code == 0, out
    want, losses = reference(script, 2, 20, 8, 0.1, seed=3, accumulate=2, clip=0.5)
    close(final_state(run_dir), want)
    # worker 0's logged loss is its own share; the mean over both workers is the reference's
    assert worker0_losses(run_dir)[5] == pytest.approx(sum(losses[:5]) / 5, rel=0.5)
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    evals = [m for m in rows if m["kind"] == "eval"]
    assert [m["step"] for m in evals] == [5, 10, 15] and all(m["mse"] > 0 for m in evals)
    assert "evaluate at step 10: mse" in out
    w0 = [m for m in rows if m["kind"] == "metric" and m["rank"] == 0]
    assert all("abs_err" in m["logged"] for m in w0)
    shown = [line for line in out.splitlines() if line.startswith("[localhost worker 0] step ")]  # the plain lines
    assert len(shown) == len(w0) and all(
        line.endswith(f" | abs_err {m['logged']['abs_err']:.4g}") for line, m in zip(shown, w0)
    ), out[-2000:]
    # lr of each interval's last step: warm-up reaches 0.1 at step 5, halves after step 10
    assert [round(m["lr"], 6) for m in w0] == [0.1, 0.1, 0.05, 0.05]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["eval_last"]["mse"] < summary["eval_first"]["mse"]
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/abs_err", "eval/mse"} <= tags
    assert sorted(e.step for e in acc.Scalars("eval/mse")) == [0, 5, 10, 15, 20]
    assert [e.step for e in acc.Scalars("train/loss")] == [5, 10, 15, 20]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bf16_autocast_follows_fp32_and_resume_keeps_the_schedule(tmp_path):
    """bf16 autocast: the loss curve stays within bf16 tolerance of fp32 one-process training.
    A bf16 run checkpointed at step 5 and resumed to 10 equals the 10 uninterrupted bf16 steps
    (the schedule's state is in the checkpoint)."""
    script = write_script(tmp_path, LOOP)
    code, run_dir, out = run_cli(
        tmp_path,
        script,
        "--gpus",
        "2",
        "--strategy",
        "allreduce",
        "--precision",
        "bf16",
        "--steps",
        "10",
        "--no-eval",
        name="bf16",
    )
    assert code == 0, out
    _, losses = reference(script, 2, 10, 8, 0.1)
    got = json.load(open(os.path.join(run_dir, "summary.json")))
    assert got["loss_first"] == pytest.approx(losses[0], rel=2e-2)
    assert got["loss_last"] == pytest.approx(losses[-1], rel=5e-2)
    code, part, out = run_cli(
        tmp_path,
        script,
        "--gpus",
        "2",
        "--strategy",
        "allreduce",
        "--precision",
        "bf16",
        "--steps",
        "5",
        "--checkpoint-every",
        "5",
        "--no-eval",
        name="part",
    )
    assert code == 0, out
    code, out = hpar_to_file(tmp_path / "resume.out", "run", "--resume", part, "--steps", "10")
    assert code == 0, out
    close(final_state(part), final_state(run_dir), rtol=1e-6)


def test_fp16_scaler_skips_a_step_with_an_inf_gradient(tmp_path):
    """fp16: GradScaler's inf/NaN check skips the optimizer step (weights unchanged), and
    the schedule still advances, without torch's "lr_scheduler.step() before
    optimizer.step()" warning, a false alarm after a skipped step (it still warns where the
    optimizer stepped no more than that); a finite step goes through."""
    cfg = RunConfig(
        script="x",
        strategy="allreduce",
        world_size=1,
        steps=2,
        batch_size=1,
        lr=0.1,
        seed=0,
        run_dir="r",
        precision="fp16",
    )
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    job = load_job(write_script(tmp_path, LOOP))
    tools = step_tools(cfg, job, opt, torch.device("cpu"))
    tools.backward((w * torch.tensor([1.0, float("inf"), 0.0])).sum())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert tools.step(opt, lambda: [w]) is False
    assert not [x for x in seen if "lr_scheduler.step()" in str(x.message)], [str(x.message) for x in seen]
    assert torch.equal(w.detach(), torch.ones(3))
    opt.zero_grad()
    tools.backward(w.sum())
    assert tools.step(opt, lambda: [w]) is True
    assert torch.all(w.detach() < 1)
    assert tools.scheduler.last_epoch == 2
    # what a checkpoint keeps of the loop (StepTools.state_dict): the scale the skipped step
    # halved and the schedule's position come back in a fresh run's tools
    resumed = step_tools(cfg, job, torch.optim.SGD([w], lr=0.1), torch.device("cpu"))
    resumed.load_state_dict(tools.state_dict())
    assert resumed.scaler.get_scale() == tools.scaler.get_scale() < 2.0**16
    assert resumed.scheduler.last_epoch == 2
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.warns(UserWarning, match=r"lr_scheduler\.step\(\)` before"):
        step_schedule(torch.optim.lr_scheduler.LambdaLR(other, lambda s: 1.0), stepped=True)


def test_contract_hooks_are_checked(tmp_path):
    bad = write_script(
        tmp_path,
        LOOP.replace(
            "return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 ** (s // 10))",
            "return 3",
        ),
        name="bad_sched.py",
    )
    job = load_job(bad)
    with pytest.raises(JobError, match=r"scheduler\(\) returned int"):
        job.build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    bad_log = write_script(
        tmp_path, LOOP.replace('return {"abs_err": (output - targets).abs().mean()}', "return [1.0]"), name="bad_log.py"
    )
    with pytest.raises(JobError, match=r"log\(\) returned list"):
        load_job(bad_log).run_log(1, torch.zeros(2), torch.zeros(2))
    bad_hpar = write_script(
        tmp_path, LOOP.replace('"log_every": 5}', '"log_every": 5, "precision": 16}'), name="bad_hpar.py"
    )
    with pytest.raises(JobError, match=r"HPAR\['precision'\] is 16, expected a string"):
        load_job(bad_hpar)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--strategy", "pipeline", "--schedule", "async", "--precision", "fp16"],
            "--precision fp16 is not supported with --schedule async",
        ),
        (["--strategy", "pipeline", "--accumulate", "2"], "--accumulate does not apply to --strategy pipeline"),
        (["--strategy", "allreduce", "--accumulate", "0"], "--accumulate must be at least 1"),
        (["--strategy", "allreduce", "--clip-grad-norm", "-1"], "--clip-grad-norm must not be negative"),
    ],
)
def test_flags_a_strategy_cannot_honour_are_refused_before_anything_starts(tmp_path, args, message):
    from conftest import embed_script

    script = write_script(tmp_path, LOOP if "pipeline" in args else embed_script(steps=4))
    res = hpar("run", script, "--gpus", "2", "--run-dir", str(tmp_path / "r"), "--plain", *args)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert not os.path.exists(tmp_path / "r" / "config.json")


def test_a_bad_loop_flag_is_refused_before_the_planner_profiles(tmp_path):
    """--strategy auto profiles the script before it picks a plan; a loop flag out of range is
    refused before that: the whole output (stdout and stderr to a file, as in a batch job) is
    the one error line, no "chose" line, exit 2, no run directory."""
    from conftest import embed_script

    script = write_script(tmp_path, embed_script(steps=4))
    code, out = hpar_to_file(
        tmp_path / "out.txt", "run", script, "--gpus", "2", "--run-dir", str(tmp_path / "r"), "--accumulate", "0"
    )
    assert code == 2, out
    lines = [l for l in out.splitlines() if l.strip()]
    assert len(lines) == 1 and "--accumulate must be at least 1, got 0" in lines[0], out
    assert not os.path.exists(tmp_path / "r")


EMBED_SCHEDULED = """
import torch, torch.nn as nn
HPAR = {"steps": 12, "batch_size": 4, "lr": 0.1, "log_every": 4}
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(200, 8)
        self.out = nn.Linear(8, 1)
    def forward(self, x):
        return self.out(self.emb(x)).squeeze(1)
def model(): return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randint(0, 200, (batch_size,), generator=g), torch.randn(batch_size, generator=g)
def loss(o, t): return ((o - t) ** 2).mean()
def optimizer(params): return torch.optim.Adam(params, lr=0.1)
def scheduler(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=12)
def evaluate(model):
    x = torch.arange(200)
    return {"mean_out": float(model(x).mean()), "draw": float(torch.rand(1))}
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_allreduce_sparse_clips_sparse_gradients_like_one_process(tmp_path):
    """allreduce-sparse makes the embedding's gradient sparse (rows gathered from every
    worker), which torch's clip_grad_norm_ refuses (`examples/lm.py --strategy
    allreduce-sparse` crashed at its first step): hpar's clipping coalesces it, so 2 workers x 2
    micro-steps with a schedule and clipping equal one process on the 4 concatenated batches."""
    script = write_script(
        tmp_path,
        EMBED_SCHEDULED.replace("torch.optim.Adam(params, lr=0.1)", "torch.optim.SGD(params, lr=0.1, momentum=0.9)"),
    )
    code, run_dir, out = run_cli(
        tmp_path,
        script,
        "--gpus",
        "2",
        "--strategy",
        "allreduce-sparse",
        "--accumulate",
        "2",
        "--clip-grad-norm",
        "0.3",
    )
    assert code == 0, out
    want, _ = reference(script, 2, 12, 4, 0.1, accumulate=2, clip=0.3)
    close(final_state(run_dir), want)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["strategy"] == "allreduce-sparse" and summary["steps"] == 12


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["hybrid", "ps"])
def test_parameter_servers_follow_the_schedule(tmp_path, strategy):
    """The servers replay the script's schedule (one-cycle, Adam), sum each worker's pushes of
    its 2 micro-steps and clip by the global norm over workers and servers: 2 workers and a
    server equal one process with the same schedule and clipping on the 4 concatenated
    batches of each step, also while
    evaluate() (which draws a random number) runs every 4 steps on a copy with the served rows."""
    script = write_script(tmp_path, EMBED_SCHEDULED)
    code, run_dir, out = run_cli(
        tmp_path,
        script,
        "--gpus",
        "2",
        "--strategy",
        strategy,
        "--eval-every",
        "4",
        "--accumulate",
        "2",
        "--clip-grad-norm",
        "0.3",
    )
    assert code == 0, out
    want, _ = reference(script, 2, 12, 4, 0.1, accumulate=2, clip=0.3)
    close(final_state(run_dir), want)
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    evals = {m["step"]: m["mean_out"] for m in rows if m["kind"] == "eval"}
    assert sorted(evals) == [4, 8]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert len({summary["eval_first"]["mean_out"], evals[4], evals[8], summary["eval_last"]["mean_out"]}) == 4
    # the embedding's rows of steps 1-11 were requested during the step before, except after
    # the evaluations of steps 4 and 8 (the whole-table pulls share the reply tags)
    assert summary["pulls_ahead"] == 9
    # the PS bytes of a step do not include the evaluation's pull of every row
    by_step = [m["bytes_recv"] for m in rows if m["kind"] == "metric" and m["role"] == "worker" and m["rank"] == 0]
    assert max(by_step) < 200 * 8 * 4


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_plan_can_turn_the_pull_ahead_off(tmp_path):
    """`"pull_ahead": false` in a plan file (how BENCHMARKS.md's A/B was run): `hpar run
    --strategy hybrid --plan` then requests no rows a step early, and trains the same model."""
    from hpar.strategies.specs.decision import Plan

    script = write_script(tmp_path, EMBED_SCHEDULED)
    plan = tmp_path / "plan.json"
    plan.write_text(
        Plan(
            strategy="hybrid",
            placement={},
            partitions={},
            servers=1,
            stages=[],
            micro_batches=1,
            schedule="1f1b",
            reason="",
            candidates=[],
            pull_ahead=False,
        ).to_json()
    )
    code, run_dir, out = run_cli(
        tmp_path, script, "--gpus", "2", "--strategy", "hybrid", "--plan", str(plan), "--no-eval"
    )
    assert code == 0, out
    want, _ = reference(script, 2, 12, 4, 0.1)
    close(final_state(run_dir), want)
    assert json.load(open(os.path.join(run_dir, "summary.json")))["pulls_ahead"] == 0


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "torch-gpipe"])
def test_pipeline_stages_follow_the_schedule(tmp_path, schedule):
    """Each stage steps the script's schedule once per batch: 2 stages equal one process."""
    script = write_script(tmp_path, LOOP)
    code, run_dir, out = run_cli(
        tmp_path,
        script,
        "--gpus",
        "2",
        "--strategy",
        "pipeline",
        "--schedule",
        schedule,
        "--micro-batches",
        "2",
        "--no-eval",
    )
    assert code == 0, out
    want, _ = reference(script, 1, 20, 8, 0.1)
    close(final_state(run_dir), want)


def test_a_model_that_cannot_run_at_the_precision_is_refused_before_anything_starts(tmp_path):
    """A forward pass that fails under bf16 autocast on CPU is caught by the pre-start check:
    one line naming the file and --precision, exit 2, no run directory."""
    script = write_script(
        tmp_path,
        LOOP.replace(
            "    def forward(self, x):\n        return self.body(x)",
            "    def forward(self, x):\n        if torch.is_autocast_enabled('cpu'):\n"
            "            raise RuntimeError('no bf16 kernel')\n        return self.body(x)",
        ),
    )
    res = hpar(
        "run",
        script,
        "--gpus",
        "1",
        "--strategy",
        "allreduce",
        "--precision",
        "bf16",
        "--run-dir",
        str(tmp_path / "r"),
        "--plain",
    )
    assert res.returncode == 2, res.stdout + res.stderr
    first = res.stderr.splitlines()[0]
    assert script in first and "--precision bf16" in first and "no bf16 kernel" in first
    assert not os.path.exists(tmp_path / "r" / "config.json")
