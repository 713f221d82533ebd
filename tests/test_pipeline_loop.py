"""The training loop under the pipeline strategy (strategies/runtimes/pipeline/stage_loop.py): clipping
by the norm over every stage, fp16's inf/NaN check agreed by every stage, the LR schedule,
evaluate() during training on the gathered model, the script's log() at the last stage;
runtime-level against one process, and through the real `hpar run`."""

import json
import os

import pytest
import torch

from hpar.strategies.job.config import RunConfig
from hpar.strategies.job.contract import load_job
from hpar.strategies.job.loop import DTYPES
from hpar.strategies.plan.stage_cuts import split_micro
from hpar.strategies.runtimes.pipeline.stage_loop import async_clip_threshold

from conftest import write_script
from test_pipeline import run_pipeline
from test_training_loop import run_cli

PIPE = '''
import torch, torch.nn as nn
HPAR = {"steps": 20, "batch_size": 8, "lr": 0.1, "log_every": 1}
BAD_STEP = -1   # the batch of this step makes the first stage's gradient inf (and only its)

class Gate(nn.Module):
    """Identity in the forward (w*c - (w*c).detach() is 0); in the backward w gets sum(g * c),
    c the inputs' marker column: 0, or 1e38 in the bad step (inf once multiplied by g)."""
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 0.5))
    def forward(self, x):
        wc = self.w * x[:, 4:]
        return x[:, :4] + (wc - wc.detach())

def model():
    return nn.Sequential(Gate(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(1000 + rank)
    for i in range(10_000):
        x = torch.randn(batch_size, 4, generator=g)
        c = torch.full((batch_size, 1), 1e38 if i == BAD_STEP else 0.0)
        yield torch.cat([x, c], 1), x.sum(1, keepdim=True)
def loss(output, targets):
    return ((output - targets) ** 2).mean()
def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)
def scheduler(opt):   # linear warm-up over 5 steps, then halve every 10
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.5 ** (s // 10))
def log(step, output, targets):
    return {"abs_err": (output - targets).abs().mean(), "rows": float(output.shape[0])}
def evaluate(model):
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(7))
    x = torch.cat([x, torch.zeros(64, 1)], 1)
    return {"mse": float(((model(x) - x[:, :4].sum(1, keepdim=True)) ** 2).mean())}
'''


def one_process(
    script: str,
    steps: int,
    batch_size: int,
    micro: int,
    lr: float,
    seed: int,
    clip: float = 0.0,
    precision: str = "fp32",
) -> tuple[dict, list[bool]]:
    """One process on the same batches: micro-batches accumulated (each loss / M), under
    autocast and torch's GradScaler for fp16, clipped by the global norm, the schedule stepped:
    what gpipe/1f1b with any number of stages must equal. Returns (state_dict, stepped per step)."""
    job = load_job(script)
    torch.manual_seed(seed)
    model = job.build_model()
    opt = job.build_optimizer(model.parameters(), lr)
    sched = job.build_scheduler(opt)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    batches = job.batches(0, 1, batch_size)
    stepped = []
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        for xm, ym in zip(split_micro(x, micro), split_micro(y, micro)):
            with torch.autocast("cpu", dtype=DTYPES.get(precision, torch.float32), enabled=precision != "fp32"):
                loss = job.compute_loss(model(xm), ym)
            scaler.scale(loss / micro).backward()
        scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = scaler.get_scale() if scaler.is_enabled() else 0
        scaler.step(opt)
        scaler.update()
        stepped.append(not scaler.is_enabled() or scaler.get_scale() >= before)
        sched.step()
    return model.state_dict(), stepped


def assert_close(state: dict, ref: dict, rtol: float = 1e-5) -> None:
    assert state.keys() == ref.keys()
    for k in ref:
        err = (state[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)
        assert err < rtol, f"{k}: relative error {err:.2e}"


def metrics(logs: list[str], rank: int) -> list[dict]:
    return [json.loads(l[len("@hpar metric ") :]) for l in logs[rank].splitlines() if l.startswith("@hpar metric ")]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule, world", [("1f1b", 3), ("gpipe", 2)])
def test_synchronous_pipeline_clips_by_the_norm_over_every_stage(tmp_path, schedule, world):
    """K stages with the script's schedule and --clip-grad-norm equal one process that clips
    the whole model's gradient (micro-batches as the accumulation), 1e-5 after 20 steps; the
    clipping acts (the unclipped run differs)."""
    script = write_script(tmp_path, PIPE)
    codes, summary, state, logs = run_pipeline(
        tmp_path,
        PIPE,
        timeout=120,
        world_size=world,
        schedule=schedule,
        steps=20,
        clip_grad_norm=0.5,
        eval=False,
        log_every=5,
    )
    assert codes == [0] * world, logs
    want, _ = one_process(script, 20, 8, 4, 0.1, 3, clip=0.5)
    assert_close(state, want)
    unclipped, _ = one_process(script, 20, 8, 4, 0.1, 3)
    assert any((want[k] - unclipped[k]).abs().max() > 1e-3 for k in want)
    assert [round(m["lr"], 6) for m in metrics(logs, 0)] == [0.1, 0.1, 0.05, 0.05]  # the schedule, per batch


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_fp16_step_with_inf_on_one_stage_is_skipped_on_every_stage(tmp_path):
    """fp16 (autocast + GradScaler): the batch of step 3 makes only stage 0's gradient inf; every
    stage skips that step (the found-inf flags are reduced over the stages) and backs off the
    same scale, so 2 stages still equal one process with torch's GradScaler."""
    text = PIPE.replace("BAD_STEP = -1", "BAD_STEP = 3")
    script = write_script(tmp_path, text)
    codes, summary, state, logs = run_pipeline(
        tmp_path,
        text,
        timeout=120,
        world_size=2,
        schedule="1f1b",
        steps=8,
        precision="fp16",
        clip_grad_norm=5.0,
        eval=False,
        log_every=1,
    )
    assert codes == [0, 0], logs
    want, stepped = one_process(script, 8, 8, 4, 0.1, 3, clip=5.0, precision="fp16")
    # step 1 overflows fp16 at the initial scale 2**16 anyway (as in one process); step 3 only by the marker
    assert (
        one_process(write_script(tmp_path, PIPE, name="clean.py"), 8, 8, 4, 0.1, 3, clip=5.0, precision="fp16")[1]
        == [True, False] + [True] * 6
    )
    assert stepped == [True, False, True, False, True, True, True, True]
    assert_close(state, want, rtol=1e-4)
    for rank in (0, 1):
        assert [m["step"] for m in metrics(logs, rank) if m.get("skipped_step")] == [2, 4], rank
    assert torch.equal(state["0.w"], torch.full((4,), 0.5))  # the inf gradient never reached the weights


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_torch_pipelining_peer_runs_its_stages_under_bf16_autocast(tmp_path):
    """--schedule torch-gpipe --precision bf16: torch's PipelineStage runs each stage module under
    autocast (bf16 activations between the stages); the weights follow fp32 one-process training
    within bf16 tolerance, and differ from it (autocast did act)."""
    script = write_script(tmp_path, PIPE)
    codes, summary, state, logs = run_pipeline(
        tmp_path, PIPE, timeout=120, world_size=2, schedule="torch-gpipe", steps=10, precision="bf16", eval=False
    )
    assert codes == [0, 0], logs
    want, _ = one_process(script, 10, 8, 4, 0.1, 3)
    assert_close(state, want, rtol=5e-2)
    assert any((state[k] - want[k]).abs().max() > 1e-5 for k in want)


def test_async_schedules_clip_each_stage_by_its_share():
    """Asynchronous schedules clip per stage, the threshold scaled to the micro-batches an
    update holds: 1/M of a batch for async/stash/predict, the whole batch for 2bw."""
    cfg = RunConfig(
        script="x",
        strategy="pipeline",
        world_size=2,
        steps=1,
        batch_size=8,
        lr=0.1,
        seed=0,
        run_dir="r",
        schedule="async-predict",
        micro_batches=4,
        clip_grad_norm=2.0,
    )
    assert async_clip_threshold(cfg, 1) == 0.5
    assert async_clip_threshold(cfg, 4) == 2.0


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"schedule": "async-stash", "precision": "fp16"},
            "--precision fp16 is not supported with --schedule async-stash",
        ),
        (
            {"schedule": "torch-1f1b", "clip_grad_norm": 1.0},
            "--clip-grad-norm is not supported with --schedule torch-1f1b",
        ),
        ({"schedule": "torch-gpipe", "eval_every": 5}, "--eval-every is not supported with --schedule torch-gpipe"),
        (
            {"schedule": "torch-gpipe", "precision": "fp16"},
            "--precision fp16 is not supported with --schedule torch-gpipe",
        ),
    ],
)
def test_pipeline_flags_that_cannot_be_honoured_are_refused(changes, message):
    """What the pipeline cannot honour is refused by the configuration, before anything starts
    (the CLI turns it into one line and exit 2: tests/test_training_loop.py)."""
    fields = dict(script="x", strategy="pipeline", world_size=2, steps=1, batch_size=8, lr=0.1, seed=0, run_dir="r")
    with pytest.raises(ValueError, match=message):
        RunConfig(**{**fields, **changes})
    RunConfig(**{**fields, **changes, "schedule": "1f1b"})  # hpar's own synchronous schedule runs it


def rows(run_dir: str) -> list[dict]:
    return [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_pipeline_cli_fp16_clipping_eval_and_log(tmp_path):
    """`hpar run --strategy pipeline` with fp16, clipping, --eval-every and a log() hook: it
    trains; evaluate() runs on the gathered model every 4 steps (metrics.jsonl, the progress
    lines, TensorBoard); the last stage's log() metrics of its last micro-batch go with its
    progress reports and to TensorBoard."""
    script = write_script(
        tmp_path, PIPE.replace('"steps": 20', '"steps": 12').replace('"log_every": 1', '"log_every": 4')
    )
    code, run_dir, out = run_cli(
        tmp_path,
        script,
        "--gpus",
        "2",
        "--strategy",
        "pipeline",
        "--schedule",
        "1f1b",
        "--micro-batches",
        "2",
        "--precision",
        "fp16",
        "--clip-grad-norm",
        "1.0",
        "--eval-every",
        "4",
        "--seed",
        "3",
    )
    assert code == 0, out
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["eval_last"]["mse"] < 0.5 * summary["eval_first"]["mse"]
    got = rows(run_dir)
    evals = [m for m in got if m["kind"] == "eval"]
    assert [m["step"] for m in evals] == [4, 8] and all(m["rank"] == 0 for m in evals)
    assert "evaluate at step 8: mse" in out
    assert summary["eval_first"]["mse"] > evals[0]["mse"] > evals[1]["mse"]
    last = [m for m in got if m["kind"] == "metric" and m["rank"] == 1]
    assert [m["step"] for m in last] == [4, 8, 12]
    assert all(m["logged"]["rows"] == 4.0 and m["logged"]["abs_err"] > 0 for m in last)  # one micro-batch: 8 / 2
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    acc.Reload()
    assert {"train/loss", "train/lr", "train/abs_err", "eval/mse"} <= set(acc.Tags()["scalars"])
    assert sorted(e.step for e in acc.Scalars("eval/mse")) == [0, 4, 8, 12]
    assert [e.step for e in acc.Scalars("train/abs_err")] == [4, 8, 12]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_async_pipeline_with_clipping_evaluates_the_step_boundary_weights(tmp_path):
    """An asynchronous schedule with clipping and --eval-every: the model evaluated after step 3
    is the one every stage holds after the updates of the first 3 batches' micro-batches, i.e.
    what a run of 3 steps ends with (worker processes as `hpar run` starts them; the CLI's
    path for eval records is covered by test_pipeline_cli_fp16_clipping_eval_and_log)."""
    common = dict(timeout=120, world_size=2, schedule="async-stash", micro_batches=4, clip_grad_norm=0.5, seed=3)
    codes, _, _, logs = run_pipeline(tmp_path, PIPE, steps=6, eval_every=3, **common)
    assert codes == [0, 0], logs
    at3 = [json.loads(l[len("@hpar eval ") :]) for l in logs[0].splitlines() if l.startswith("@hpar eval ")]
    assert [m["step"] for m in at3] == [3]
    (tmp_path / "short").mkdir()
    codes, short, _, logs = run_pipeline(tmp_path / "short", PIPE, steps=3, **common)
    assert codes == [0, 0], logs
    assert at3[0]["mse"] == pytest.approx(short["eval_last"]["mse"], rel=1e-6)
