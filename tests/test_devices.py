"""Device choice per host (issue 13, item 5) and device-side details (item 9), on CPU."""

import io
import os

import pytest
import torch
from rich.console import Console

from hpar.launcher.run.device_choice import choose_devices, describe

from conftest import hpar, run_processes


def test_device_per_host_from_what_each_host_sees():
    assert choose_devices([("a", 2, 0), ("b", 2, 0)])[0] == "cpu"
    device, per_host = choose_devices([("a", 2, 4), ("b", 2, 2)])
    assert device == "cuda" and [d.device for d in per_host] == ["cuda", "cuda"]
    assert choose_devices([("a", 2, 4)], "cpu")[0] == "cpu"
    with pytest.raises(ValueError, match="host b sees 1 GPU.* runs 2 worker.*--device cpu"):
        choose_devices([("a", 2, 2), ("b", 2, 1)])  # fewer GPUs than workers on a CUDA host
    with pytest.raises(ValueError, match="host b sees no GPU"):
        choose_devices([("a", 2, 2), ("b", 2, 0)])  # NCCL needs every worker on a GPU
    with pytest.raises(ValueError, match="--device cuda: host a sees 0 GPU"):
        choose_devices([("a", 1, 0)], "cuda")
    line = describe(*choose_devices([("a", 2, 8)]), servers=1)
    assert "a: 2 worker(s) on cuda:0..1 of 8 GPU(s)" in line and "NCCL" in line and "server(s) on CPU (gloo)" in line


def _resolve(tmp_path, monkeypatch, seen: dict, device="auto"):
    from hpar.launcher.commands import run as run_command
    from hpar.launcher.run.flags import Flags
    from hpar.launcher.hosts import remote
    from hpar.launcher.procs.ssh import SSHOptions
    from conftest import write_script

    monkeypatch.setattr(remote, "prepare_remote", lambda *a, **kw: (SSHOptions(gpus=seen), "10.0.0.1"))
    from hpar.launcher.hosts import reach

    monkeypatch.setattr(reach, "check_reachable", lambda *a, **kw: None)  # hosts a and b exist only here
    from hpar.launcher.run import run_hosts

    monkeypatch.setattr(run_hosts, "local_gpus", lambda: 0)  # the launcher itself has no GPU
    out = io.StringIO()
    cfg, _, _ = run_command.resolve(
        Console(file=out, soft_wrap=True),
        Flags.of(
            script=write_script(tmp_path),
            gpus=4,
            hosts="a:2,b:2",
            strategy="allreduce",
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
            device=device,
        ),
    )
    return cfg, out.getvalue()


def test_gpu_hosts_run_on_cuda_from_a_launcher_without_gpus(tmp_path, monkeypatch):
    cfg, printed = _resolve(tmp_path, monkeypatch, {"a": 2, "b": 4})
    assert cfg.device == "cuda" and cfg.backend == "nccl"
    assert printed.count("devices:") == 1 and "b: 2 worker(s) on cuda:0..1 of 4 GPU(s)" in printed
    assert _resolve(tmp_path, monkeypatch, {"a": 2, "b": 4}, device="cpu")[0].device == "cpu"
    with pytest.raises(ValueError, match="host b sees 1 GPU"):
        _resolve(tmp_path, monkeypatch, {"a": 2, "b": 1})


@pytest.mark.timeout(120)
def test_device_cuda_without_gpus_is_one_line_and_exit_2(tiny_script, tmp_path):
    run_dir = str(tmp_path / "run")
    res = hpar(
        "run",
        tiny_script,
        "--gpus",
        "2",
        "--device",
        "cuda",
        "--run-dir",
        run_dir,
        "--plain",
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines() == [
        "hpar: --device cuda: host localhost sees 0 GPU(s) for 2 worker(s) (one GPU per worker); "
        "lower --gpus or its slots to 0, or pass --device cpu"
    ]
    assert not os.path.exists(os.path.join(run_dir, "config.json")) and not run_processes(run_dir)


def test_heartbeat_reads_the_workers_own_gpu(monkeypatch):
    from hpar.workers import report

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: asked.append(device) or 123)
    assert report.process_figures(torch.device("cuda", 3))["gpu_bytes"] == 123
    assert asked == [torch.device("cuda", 3)]  # not the heartbeat thread's current device (GPU 0)
    assert "gpu_bytes" not in report.process_figures(torch.device("cpu"))


def test_rng_state_carries_the_cuda_generator(monkeypatch):
    from hpar.strategies.common.devices import rng_state, set_rng_state

    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.tensor([7], dtype=torch.uint8))
    restored = []
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device=None: restored.append((int(state[0]), device))
    )
    state = rng_state(torch.device("cuda", 1))
    assert set(state) == {"cpu", "cuda"}
    set_rng_state(state, torch.device("cuda", 1))
    assert restored == [(7, torch.device("cuda", 1))]
    set_rng_state(torch.get_rng_state(), torch.device("cpu"))  # checkpoints from before: CPU state alone


def test_compute_timer_uses_cuda_events_on_a_gpu(monkeypatch):
    from hpar.strategies.common.devices import ComputeTimer

    class Event:
        made = []

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t, self.synced = None, False
            Event.made.append(self)

        def record(self):
            self.t = len(Event.made) * 2.0  # milliseconds, as CUDA reports them

        def synchronize(self):
            self.synced = True

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = ComputeTimer(torch.device("cuda", 0))
    for _ in range(2):
        timer.start()
        timer.stop()
    assert timer.take() == pytest.approx(0.004) and Event.made[-1].synced  # 2 x 2 ms, read once
    cpu = ComputeTimer(torch.device("cpu"))
    cpu.start()
    cpu.stop()
    assert 0 <= cpu.take() < 1 and cpu.take() == 0
