"""Profiling and timing on the workers' device (issue 13, item 7), on CPU: per-layer profile
times and pipeline compute/idle come from CUDA events on CUDA (a fake event class stands for
them), the profile records its device and a plan says where its compute figures come from,
and ``--device-tflops`` / ``--device-mem-gbps`` describe a device you do not have (roofline)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console
from torch import nn

from hpar.launcher.commands.profile import profile
from hpar.strategies.plan import roofline
from hpar.strategies.specs.decision import Plan

from conftest import write_script


class FakeEvent:
    """torch.cuda.Event on a CPU-only torch: each record() advances a fake GPU clock by 5 ms."""

    clock_ms = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t, self.synced = None, False

    def record(self, stream=None):
        FakeEvent.clock_ms += 5.0
        self.t = FakeEvent.clock_ms

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        assert end.t is not None and end.synced, "read an event before waiting for it"
        return end.t - self.t


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    FakeEvent.clock_ms = 0.0


def test_profile_layer_times_come_from_cuda_events_on_cuda(fake_cuda):
    from hpar.strategies.common.devices import DeviceClock
    from hpar.strategies.profile.hooks import LayerTimer

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    clock = DeviceClock(torch.device("cuda", 0))  # the model stays on the CPU: only the clock is CUDA's
    timer = LayerTimer(list(model.named_children()), [], clock)
    with timer:
        timer.reset()
        t0 = clock.mark()
        loss = model(torch.randn(3, 4)).sum()
        t1 = clock.mark()
        loss.backward()
        end = clock.mark()
        fwd, bwd = timer.forward_s(), timer.backward_s(end)
    # every layer's forward spans exactly one fake record (5 ms): the host clock would say microseconds
    assert fwd == pytest.approx([0.005] * 3)
    assert clock.between(t0, t1) == pytest.approx(0.035)  # 3 layers x 2 marks + the end mark
    # output-gradient marks of layers 2, 1, 0 in that order, then the end mark: 5 ms apart each
    assert bwd == pytest.approx([0.005] * 3)


def test_pipeline_compute_and_idle_from_cuda_events_on_cuda(fake_cuda):
    from hpar.strategies.common.devices import ComputeTimer

    timer = ComputeTimer(torch.device("cuda", 0))  # mark at 5 ms: the step starts
    timer.start()  # 10
    timer.stop()  # 15: 5 ms of compute
    compute, idle = timer.take_step(host_idle=123.0)  # step ends at 20 ms: 15 ms of stream time
    assert compute == pytest.approx(0.005) and idle == pytest.approx(0.010)  # not the host's 123 s
    cpu = ComputeTimer(torch.device("cpu"))
    assert cpu.take_step(host_idle=0.25) == (0.0, 0.25)  # on the CPU the links' host-clock waits


def _profile(**kw):
    layers = [SimpleNamespace(flops=2e9, activation_bytes=4e6), SimpleNamespace(flops=0, activation_bytes=4e6)]
    params = [SimpleNamespace(layer=0, bytes=1e6, alpha=1.0, embedding_module=False)]
    return SimpleNamespace(layers=layers, params=params, flops=3e9, forward_flops=1e9, **kw)


def test_roofline_prices_memory_bound_layers_and_keeps_flops_only_projections():
    dev = roofline.DeviceSpec(flops=1e12, mem_Bps=1e9)
    # layer 0: 3 P + 3 A_in + 2 A_out = 3e6 + 0 + 8e6 bytes -> 11 ms > 2 ms of FLOPs (memory bound)
    # layer 1 (a ReLU: no FLOPs): 3 x 4e6 + 2 x 4e6 = 20e6 bytes -> 20 ms
    assert roofline.layer_seconds(_profile(), dev) == pytest.approx([0.011, 0.020])
    fwd, bwd = roofline.compute_seconds(_profile(), dev)  # + 1e9 FLOPs outside the layers: 1 ms
    assert fwd + bwd == pytest.approx(0.032) and fwd / (fwd + bwd) == pytest.approx(1 / 3)
    flops_only = roofline.DeviceSpec(flops=1e12)  # --device-tflops alone: as before
    assert roofline.layer_seconds(_profile(), flops_only) == pytest.approx([0.002, 0.0])
    assert roofline.update_seconds_per_byte(dev) == pytest.approx(3e-9)
    assert roofline.update_seconds_per_byte(flops_only) == pytest.approx(3 * roofline.FLOP_PER_BYTE / 1e12)
    from hpar.strategies.plan.cluster import make_cluster

    with pytest.raises(ValueError, match="--device-mem-gbps needs --device-tflops"):
        make_cluster(None, 2, 1, 1e9, 1e-5, device_mem_Bps=1e11)


def test_a_cpu_profile_for_gpu_workers_is_said_in_one_line():
    from hpar.launcher.run.plan_run import compute_mismatch

    line = compute_mismatch(Plan(compute="measured on cpu"), "cuda")
    assert "measured on cpu" in line and "--device cuda" in line and "\n" not in line
    assert compute_mismatch(Plan(compute="measured on cuda"), "cuda") is None
    assert compute_mismatch(Plan(compute="projected: 15 TFLOP/s (from a profile on cpu)"), "cuda") is None
    assert compute_mismatch(Plan(strategy="hybrid"), "cuda") is None  # no profile behind the plan


MEMORY_BOUND = """
import torch
from torch import nn
HPAR = {"batch_size": 16}
def model():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.LayerNorm(256), nn.Linear(256, 4))
def data(rank, world_size, batch_size):
    while True:
        yield torch.randn(batch_size, 64), torch.randint(0, 4, (batch_size,))
def loss(o, t):
    return nn.functional.cross_entropy(o, t)
"""


@pytest.mark.timeout(180)
def test_profile_json_projects_with_flops_and_memory_bandwidth(tmp_path):
    script = write_script(tmp_path, MEMORY_BOUND)
    out = tmp_path / "out.json"
    with open(out, "w") as f:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "hpar.launcher.cli",
                "profile",
                script,
                "--gpus",
                "2",
                "--bandwidth",
                "10Gbps",
                "--latency",
                "10us",
                "--device",
                "cpu",
                "--device-tflops",
                "100",
                "--device-mem-gbps",
                "0.001",
                "--json",
            ],
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            timeout=170,
        )
    assert res.returncode == 0, res.stderr
    d = json.loads(out.read_text())
    assert d["profile"]["device"] == "cpu"
    assert d["cluster"]["device_flops"] == 1e14 and d["cluster"]["device_mem_Bps"] == 1e6
    assert d["plan"]["compute"] == "projected: 100 TFLOP/s, 0.001 GB/s (from a profile on cpu)"
    # at 1 MB/s every layer is memory bound: compute = the bytes the layers move / 1e6 (roofline.py's
    # formula, written out here), the FLOPs (at 100 TFLOP/s) add nothing measurable
    layers, param_bytes = d["layers"], [l["param_bytes"] for l in d["layers"]]
    moved = sum(
        3 * param_bytes[i] + 3 * (layers[i - 1]["activation_bytes"] if i else 0) + 2 * l["activation_bytes"]
        for i, l in enumerate(layers)
    )
    allreduce = next(c for c in d["candidates"] if c["strategy"] == "allreduce")["breakdown"]
    assert allreduce["forward"] + allreduce["backward"] == pytest.approx(moved / 1e6, rel=1e-3)
    assert allreduce["update"] == pytest.approx(sum(p["bytes"] for p in d["parameters"]) * 3 / 1e6, rel=1e-6)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--device-mem-gbps", "900"], "--device-mem-gbps needs --device-tflops"),
        (["--device-tflops", "10", "--device-mem-gbps", "0"], "--device-mem-gbps must be positive"),
    ],
)
def test_bad_device_flags_exit_2_with_one_line(tmp_path, args, message):
    res = CliRunner().invoke(profile, [write_script(tmp_path, MEMORY_BOUND), "--bandwidth", "1Gbps"] + args)
    assert res.exit_code == 2 and res.stderr.startswith("hpar: ") and message in res.stderr
    assert res.stderr.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU to profile on")
def test_profile_on_cuda_without_a_gpu_is_refused(tmp_path):
    res = CliRunner().invoke(
        profile, [write_script(tmp_path, MEMORY_BOUND), "--bandwidth", "1Gbps", "--device", "cuda"]
    )
    assert res.exit_code == 2 and "--device cuda: this machine sees no GPU" in res.stderr


def test_hpar_run_says_when_a_cpu_profile_plans_gpu_workers(tmp_path, monkeypatch):
    """`hpar run --strategy auto` from a launcher without a GPU for hosts that have GPUs: the plan
    was measured on the CPU, and the run says so in one line."""
    from hpar.launcher.commands import run as run_command
    from hpar.launcher.run.flags import Flags
    from hpar.launcher.hosts import remote
    from hpar.launcher.procs.ssh import SSHOptions
    from hpar.strategies.profile.device import OnDevice
    from hpar.strategies.job.contract import load_job

    monkeypatch.setattr(remote, "prepare_remote", lambda *a, **kw: (SSHOptions(gpus={"a": 1, "b": 1}), "10.0.0.1"))
    from hpar.launcher.hosts import reach

    monkeypatch.setattr(reach, "check_reachable", lambda *a, **kw: None)  # hosts a and b exist only here
    from hpar.launcher.run import run_hosts

    monkeypatch.setattr(run_hosts, "local_gpus", lambda: 0)
    script = write_script(tmp_path, MEMORY_BOUND)
    out = io.StringIO()
    cfg, _, _ = run_command.resolve(
        Console(file=out, soft_wrap=True),
        Flags.of(
            script=script,
            gpus=2,
            hosts="a:1,b:1",
            strategy="auto",
            plan_file=None,
            steps=None,
            batch_size=None,
            lr=None,
            seed=None,
            log_every=None,
            run_dir=str(tmp_path / "run"),
            servers=None,
            schedule=None,
            micro_batches=None,
            checkpoint_every=None,
            resume_dir=None,
            max_restarts=0,
            stall_timeout=0,
            no_eval=False,
            plain=True,
            ssh_key=None,
            ssh_port=None,
            ssh_user=None,
            ssh_local=False,
            python_path=None,
            sync=False,
        ),
    )
    printed = out.getvalue()
    assert cfg.device == "cuda" and cfg.plan.compute == "measured on cpu"
    assert printed.count("measured on cpu, the workers run on cuda") == 1, printed
    # the profiler's batches go to its device, as a worker's do
    x, y = next(OnDevice(load_job(script), torch.device("meta")).batches(0, 1, 4))
    assert x.is_meta and y.is_meta
