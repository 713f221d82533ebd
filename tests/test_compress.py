"""``hpar run --compress`` through the real command line (strategies/job/compression.py,
strategies/runtimes/dataparallel/compress_hooks.py): fp16 on allreduce equals a hand-computed fp16
round trip of the averaged gradient, PowerSGD trains and a resumed run equals the run that
went on bit for bit, a strategy without DDP's AllReduce is refused in one line, and the
memory model counts PowerSGD's buffers."""

import json
import os

import pytest
import torch

from conftest import final_state, hpar_to_file, write_script

# weight matrices PowerSGD compresses at rank 1-2 ((n + m) r * 2 < n m), biases it sends whole
DENSE = """
import torch, torch.nn as nn
HPAR = {"steps": 1, "batch_size": 8, "lr": 0.1, "log_every": 1}
def model():
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(1000 + rank)
    while True:
        x = torch.randn(batch_size, 16, generator=g)
        yield x, x.sum(1, keepdim=True)
def loss(output, targets):
    return ((output - targets) ** 2).mean()
def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
"""


def _run(tmp_path, reap_run, name, *args):
    run_dir = str(tmp_path / name)
    reap_run(run_dir)
    code, out = hpar_to_file(tmp_path / f"{name}.log", "run", *args, "--run-dir", run_dir, "--plain", "--no-eval")
    assert code == 0, out[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        return run_dir, json.load(f), out


def _expected(script: str, half: bool) -> dict:
    """The script's SGD step (lr 0.1) on the two workers' mean gradient, each rank's gradient computed
    here; ``half``: as torch's fp16_compress_hook averages it (cast to fp16, divided by the
    world size in fp16, summed in fp16, cast back), else in fp32."""
    from hpar.strategies.job.contract import load_job

    job = load_job(script)
    torch.manual_seed(0)
    model = job.build_model()
    grads = []
    for rank in range(2):
        x, y = next(job.batches(rank, 2, 8))
        model.zero_grad()
        job.compute_loss(model(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n, p in model.named_parameters():
        p.grad = sum(g[n].half().div_(2) for g in grads).float() if half else sum(g[n] for g in grads) / 2
    job.build_optimizer(model.parameters(), 0.1).step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_fp16_equals_a_hand_computed_fp16_round_trip(tmp_path, reap_run):
    script = write_script(tmp_path, DENSE)
    run_dir, summary, _ = _run(
        tmp_path, reap_run, "fp16", script, "--gpus", "2", "--strategy", "allreduce", "--compress", "fp16"
    )
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["compress"] == {"kind": "fp16", "rank": 0}
    got, half, full = final_state(run_dir), _expected(script, True), _expected(script, False)
    assert all(torch.equal(got[n], half[n]) for n in half)
    assert any(not torch.equal(got[n], full[n]) for n in full)  # the fp16 rounding shows: the test can fail
    # 1089 parameters at 2 bytes, ring AllReduce of 2 workers: 2(N-1)/N = 1
    assert summary["bytes_per_step"]["sent"] == 1089 * 2


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_powersgd_trains_and_a_resumed_run_equals_the_run_that_went_on(tmp_path, reap_run):
    """PowerSGD rank 1 (after 2 plain steps) on allreduce: the loss falls, fewer bytes go out
    once it starts, and a run stopped after its checkpoint of step 4 and resumed to step 8
    trains the uninterrupted run's model bit for bit (error feedback, warm-start factors, step
    counter and generator are in the checkpoint)."""
    script = write_script(tmp_path, DENSE)
    flags = ("--gpus", "2", "--strategy", "allreduce", "--compress", "powersgd:1", "--checkpoint-every", "4")
    whole, summary, _ = _run(tmp_path, reap_run, "whole", script, *flags, "--steps", "8")
    assert summary["loss_last_mean"] < summary["loss_first_mean"]
    assert summary["bytes_per_step"]["sent"] < 0.6 * 1089 * 4  # 2 plain steps of 4356 B, 6 of 680 B
    part, _, _ = _run(tmp_path, reap_run, "part", script, *flags, "--steps", "5")
    from hpar.strategies.state.state import read_all, saved_keys

    keys = saved_keys(os.path.join(part, "checkpoints", "step-4"))
    assert {
        "compress.worker0.error.0",
        "compress.worker1.q.0",
        "compress.worker0.layout.0",
        "compress.worker0.meta",
    } <= keys
    code, out = hpar_to_file(
        tmp_path / "resumed.log", "run", "--resume", part, "--steps", "8", "--plain", "--no-eval", timeout=240
    )
    assert code == 0, out[-3000:]
    a, b = final_state(whole), final_state(part)
    assert all(torch.equal(a[n], b[n]) for n in a)
    # the residual carried over is not zero: a resume without it would train another model
    saved = read_all(os.path.join(part, "checkpoints", "step-4"))
    assert saved["compress.worker0.error.0"].abs().max() > 1e-3
    assert not torch.equal(saved["compress.worker0.error.0"], saved["compress.worker1.error.0"])  # each worker's own
    # the memory model's PowerSGD buffers (error feedback, P and Q) against what a worker held: within 15%
    from hpar.strategies.job.compression import Compression, powersgd_buffers

    error, factors = powersgd_buffers([(32, 16), (32,), (16, 32), (16,), (1, 16), (1,)], Compression("powersgd", 1))
    held = {k: v.numel() * v.element_size() for k, v in saved.items() if k.startswith("compress.worker0.")}
    assert error == pytest.approx(held["compress.worker0.error.0"], rel=0.15)
    assert factors == pytest.approx(held["compress.worker0.p.0"] + held["compress.worker0.q.0"], rel=0.15)


def test_compress_is_refused_in_one_line_where_it_cannot_apply(tmp_path):
    """ps has no dense AllReduce and PowerSGD cannot take fp16 mixed precision's skipped steps:
    one line each from the real command, exit 2, before a process starts; the other refusals
    (pipelines, fsdp, a bad value) are the same function's lines."""
    script = write_script(tmp_path, DENSE)
    for args, words in (
        (
            ("--strategy", "ps", "--compress", "fp16"),
            "--compress fp16: --strategy ps has no dense AllReduce through DDP",
        ),
        (
            ("--strategy", "allreduce", "--compress", "powersgd", "--precision", "fp16"),
            "--compress powersgd:2 with --precision fp16",
        ),
    ):
        code, out = hpar_to_file(
            tmp_path / "refused.log",
            "run",
            script,
            "--gpus",
            "2",
            *args,
            "--run-dir",
            str(tmp_path / "never"),
            timeout=60,
        )
        lines = [line for line in out.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in out, out
        assert not os.path.exists(tmp_path / "never")
    from hpar.strategies.job.compression import Compression
    from hpar.strategies.job.config import compress_problem

    assert "--strategy pipeline averages its replicas' gradients" in compress_problem(
        Compression("bf16"), "pipeline", "fp32"
    )
    assert "--strategy fsdp has no dense AllReduce" in compress_problem(Compression("fp16"), "fsdp", None)
    assert compress_problem(Compression("fp16"), "hybrid", "fp16") is None  # a stateless cast takes skipped steps
    assert (
        Compression.parse("powersgd") == Compression("powersgd", 2)
        and str(Compression.parse("PowerSGD:4")) == "powersgd:4"
    )
    for bad, words in (
        ("powersgd:x", "the rank is a whole number"),
        ("int8", "choose one of off, fp16"),
        ("fp16:2", "only powersgd takes a rank"),
        ("powersgd:0", "at least 1"),
    ):
        with pytest.raises(ValueError, match=words):
            Compression.parse(bad)


def test_the_cost_and_memory_models_count_compressed_bytes_and_powersgds_buffers():
    """On a synthetic profile (tests/test_memory_model.py's: four 1000 x 25000 fp32 layers):
    fp16 halves the dense AllReduce's bytes; PowerSGD rank 4 sends (n + m) 4 per matrix, pays
    for its matmuls, and the memory model counts its error feedback (the gradients' size) and
    its factors beside the other terms; over a slow link on two hosts the compressed step is
    faster."""
    from test_memory_model import MB, profile
    from hpar.strategies.job.compression import Compression
    from hpar.strategies.plan.cluster import ClusterSpec
    from hpar.strategies.plan.costmodel import estimate_allreduce
    from hpar.strategies.plan.costmodel_compress import estimate_compressed
    from hpar.strategies.plan.memory_model import predict

    prof = profile()
    slow = ClusterSpec(hosts=2, gpus_per_host=(1, 1), servers=1, bandwidth_Bps=25e6 / 8, latency_s=1e-3)
    base = estimate_allreduce(prof, slow)
    half = estimate_compressed(prof, slow, base, Compression("fp16"))
    assert half.bytes_per_step == pytest.approx(base.bytes_per_step / 2)
    low = estimate_compressed(prof, slow, base, Compression("powersgd", 4))
    assert low.bytes_per_step == pytest.approx(base.bytes_per_step * (1000 + 25000) * 4 / (1000 * 25000))
    assert low.breakdown["compress_work"] > 0 and low.step_s < half.step_s < base.step_s
    mem, plain = predict(prof, slow, low), predict(prof, slow, base)
    grads = 400 * MB
    assert mem.worker["compress"] == pytest.approx(grads + 4 * 4 * 4 * (1000 + 25000), rel=0.15)
    assert "compress" not in plain.worker and mem.worker_peak_bytes > plain.worker_peak_bytes
