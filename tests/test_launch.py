"""``hpar launch``: torchrun-style scripts run unmodified under hpar's supervision, here and on
two network-namespace test hosts; rendezvous ports of runs started at once; the environment
that reaches remote processes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from support import netns_hosts
from conftest import REPO, TINY, hpar_to_file, run_processes, wait_for, write_script

DDP = os.path.join(REPO, "examples", "ddp_digits.py")

# A torchrun-style script: joins the group itself, AllReduces its rank, prints what it got.
TORCHRUN = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank {rank}/{world} local {os.environ['LOCAL_RANK']}/{os.environ['LOCAL_WORLD_SIZE']} sum {t.item():.0f} "
      f"args {sys.argv[1:]} restart {os.environ['TORCHELASTIC_RESTART_COUNT']} "
      f"mark {os.environ.get('HPAR_MARK')} secret {os.environ.get('SECRET_FOR_TEST')}", flush=True)
if "--fail-first" in sys.argv and rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    raise RuntimeError("rank 1 fails on purpose")
dist.barrier()
dist.destroy_process_group()
"""


def launch(*args: str, log: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    """``hpar launch ARGS`` as a subprocess, stdout and stderr to the file ``log``; returns the
    output."""
    code, text = hpar_to_file(log, "launch", *args, timeout=timeout, cwd=REPO, env=env)
    return subprocess.CompletedProcess(args, code, text, "")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_launch_passes_arguments_and_torchrun_environment(tmp_path, reap_run):
    script = write_script(tmp_path, TORCHRUN, "train.py")
    run_dir = tmp_path / "run"
    reap_run(str(run_dir))
    out = launch(
        "--gpus",
        "3",
        "--plain",
        "--run-dir",
        str(run_dir),
        script,
        "--alpha",
        "1",
        "-x",
        "--gpus",
        "9",
        log=str(tmp_path / "out.txt"),
    )
    assert out.returncode == 0, out.stdout[-3000:]
    for rank in range(3):
        assert (
            f"[localhost rank {rank}] rank {rank}/3 local {rank}/3 sum 6 args ['--alpha', '1', '-x', '--gpus', '9'] "
            f"restart 0"
        ) in out.stdout, out.stdout[-3000:]
        assert (run_dir / "logs" / f"rank-{rank}.log").exists()
    assert "held by the launcher" in out.stdout and "hpar: done: 3 process(es) exited 0" in out.stdout
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["world_size"] == 3 and summary["args"][0] == "--alpha"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_launch_failure_is_reported_and_max_restarts_starts_again(tmp_path, reap_run):
    """Rank 1 raises in the first attempt: the failure is reported as theirs (rank, host, exit
    code, their traceback), every rank stops, and --max-restarts 1 starts them all again."""
    script = write_script(tmp_path, TORCHRUN, "train.py")
    run_dir = tmp_path / "run"
    reap_run(str(run_dir))
    out = launch(
        "--gpus",
        "2",
        "--plain",
        "--max-restarts",
        "1",
        "--run-dir",
        str(run_dir),
        script,
        "--fail-first",
        log=str(tmp_path / "b.txt"),
    )
    assert out.returncode == 0, out.stdout[-3000:]
    # the script's own process exits 1 with its traceback, or, now and then, gloo's threads abort
    # its interpreter's shutdown after the traceback ("terminate called without an active
    # exception"): hpar reports what the process ended with, rank and host named either way
    assert (
        "rank 1 on localhost failed: exit code 1" in out.stdout
        or "rank 1 on localhost failed: killed by SIGABRT" in out.stdout
    ), out.stdout[-3000:]
    assert "RuntimeError: rank 1 fails on purpose" in out.stdout  # their traceback, in the failure report
    assert "hpar: restart 1/1" in out.stdout and "[localhost rank 1] rank 1/2 local 1/2 sum 3" in out.stdout
    assert "restart 1 mark" in out.stdout
    import json

    assert json.loads((run_dir / "summary.json").read_text())["restarts"] == 1


def test_contract_and_torchrun_scripts_are_told_apart(tmp_path):
    from click.testing import CliRunner
    from hpar.launcher.cli import main
    from hpar.launcher.commands.launch import script_kind

    contract, torchrun = write_script(tmp_path, TINY), write_script(tmp_path, TORCHRUN, "train.py")
    assert (
        script_kind(contract) == "contract" and script_kind(torchrun) == "torchrun" and script_kind(DDP) == "torchrun"
    )
    runner = CliRunner()
    result = runner.invoke(main, ["launch", "--run-dir", str(tmp_path / "r1"), contract])
    assert result.exit_code == 2 and "follows hpar's contract" in result.stderr and "hpar run" in result.stderr
    for command in (["run", DDP, "--run-dir", str(tmp_path / "r2")], ["profile", DDP]):
        result = runner.invoke(main, command)
        assert result.exit_code == 2, result.output
        assert "cannot profile" in result.stderr and "hpar launch" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    (tmp_path / "broken.py").write_text("def f(:\n")
    result = runner.invoke(main, ["launch", str(tmp_path / "broken.py")])
    assert result.exit_code == 2 and "broken.py:1: syntax error" in result.stderr
    result = runner.invoke(main, ["launch", "--env", "NOT_SET_ANYWHERE_42", torchrun])
    assert result.exit_code == 2 and "--env NOT_SET_ANYWHERE_42" in result.stderr
    assert not any((tmp_path / d).exists() for d in ("r1", "r2"))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_launch_runs_the_ddp_example(tmp_path, reap_run):
    run_dir = tmp_path / "run"
    reap_run(str(run_dir))
    out = launch("--gpus", "2", "--plain", "--run-dir", str(run_dir), DDP, "--epochs", "1", log=str(tmp_path / "o.txt"))
    assert out.returncode == 0, out.stdout[-3000:]
    accuracy = float(re.search(r"\[localhost rank 0\] epoch 0 validation accuracy ([0-9.]+)", out.stdout).group(1))
    assert accuracy > 0.3, out.stdout[-2000:]  # 10 classes: chance is 0.1
    assert any('"kind":"heartbeat","role":"rank","rank":1' in line for line in open(run_dir / "metrics.jsonl"))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_runs_started_at_once_do_not_share_a_port(tmp_path):
    """Both ask for the same port (HPAR_MASTER_PORT): the launcher that gets it holds it, the
    other takes another free port; both finish."""
    script = write_script(tmp_path, TORCHRUN, "train.py")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HPAR_MASTER_PORT=str(port))
    procs = []
    for i in range(2):
        log = open(tmp_path / f"out{i}.txt", "w")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "hpar.launcher.cli",
                    "launch",
                    "--gpus",
                    "2",
                    "--plain",
                    "--run-dir",
                    str(tmp_path / f"run{i}"),
                    script,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env,
            )
        )
    codes = [p.wait(timeout=200) for p in procs]
    texts = [(tmp_path / f"out{i}.txt").read_text() for i in range(2)]
    assert codes == [0, 0], texts
    ports = [int(re.search(r"rendezvous at 127\.0\.0\.1:([0-9]+)", t).group(1)) for t in texts]
    assert ports[0] != ports[1] and port in ports, ports
    assert not run_processes(str(tmp_path / "run0")) and not run_processes(str(tmp_path / "run1"))


def test_environment_allowlist(monkeypatch):
    from hpar.launcher.hosts.environ import allowlisted, describe, parse_env_flags
    from hpar.launcher.procs.local import ProcessSpec
    from hpar.launcher.procs.srun_tasks import step_environment
    from hpar.launcher.procs.ssh import remote_command, remote_environment

    environ = {
        "PYTHONPATH": "/p",
        "NCCL_DEBUG": "INFO",
        "GLOO_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": "4",
        "TORCH_LOGS": "dynamo",
        "HF_HOME": "/hf",
        "WANDB_API_KEY": "k",
        "AWS_SECRET_ACCESS_KEY": "no",
        "PATH": "/bin",
        "HOME": "/root",
        "CUDA_VISIBLE_DEVICES": "0",
        "HPAR_CONFIG": "/x",
        "SSH_AUTH_SOCK": "/s",
    }
    assert set(allowlisted(environ)) == {
        "PYTHONPATH",
        "NCCL_DEBUG",
        "GLOO_SOCKET_IFNAME",
        "OMP_NUM_THREADS",
        "TORCH_LOGS",
    }  # HF_*, WANDB_*: only with --env (issue 61)
    assert parse_env_flags(("AWS_SECRET_ACCESS_KEY", "A=1=2"), environ) == {"AWS_SECRET_ACCESS_KEY": "no", "A": "1=2"}
    for bad in ("1X=2", "A B", "UNSET_HERE"):
        with pytest.raises(ValueError, match="--env"):
            parse_env_flags((bad,), environ)
    line = describe({"EXTRA": "v"}, environ)
    shown, _, held = line.partition("; ")
    assert "EXTRA (--env)" in shown and "WANDB_API_KEY" not in shown and "WANDB_API_KEY" in held
    assert "k" not in line.split(":", 1)[1].replace(";", ",").split(", ")
    step = step_environment({"EXTRA": "v"}, dict(environ, SLURM_JOB_ID="3", SLURM_NTASKS="2"))
    assert step["SLURM_JOB_ID"] == "3" and "SLURM_NTASKS" not in step and step["EXTRA"] == "v"
    assert "AWS_SECRET_ACCESS_KEY" not in step and "CUDA_VISIBLE_DEVICES" not in step and step["PATH"] == "/bin"
    for key in list(os.environ):
        monkeypatch.delenv(key)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    spec = ProcessSpec("worker", 0, "h", ("python3", "-c", "1"), {"RANK": "0"})
    sent = remote_environment(spec)  # over the channel's stdin; the command holds no environment
    assert sent["NCCL_DEBUG"] == "INFO" and sent["RANK"] == "0" and "WANDB_API_KEY" not in sent
    assert "AWS_SECRET_ACCESS_KEY" not in sent and "PATH" not in sent and "HPAR_CONFIG" not in sent
    assert "NCCL_DEBUG=" not in remote_command(spec, cwd="/w") and "RANK=" not in remote_command(spec, cwd="/w")


# --- on two network-namespace test hosts ------------------------------------------------------


@pytest.fixture(scope="module")
def hosts():
    yield from netns_hosts.make_hosts(2)


def _hosts_file(tmp_path, hosts, slots: int = 1) -> str:
    path = tmp_path / "hosts.txt"
    path.write_text("".join(f"root@{a}:22 slots={slots}\n" for a in hosts.addresses))
    return str(path)


def _netns(test):
    for mark in (pytest.mark.timeout(240), pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.netns):
        test = mark(test)
    return test


@_netns
def test_launch_ddp_example_on_two_hosts(hosts, tmp_path):
    out = launch(
        "--hosts",
        _hosts_file(tmp_path, hosts),
        "--ssh-key",
        hosts.key,
        "--plain",
        "--run-dir",
        str(tmp_path / "run"),
        DDP,
        "--epochs",
        "1",
        log=str(tmp_path / "o.txt"),
    )
    assert out.returncode == 0, out.stdout[-3000:]
    assert "preflight: 2 host(s) ok" in out.stdout and "bound by rank 0" in out.stdout
    assert f"[{hosts.addresses[0]} rank 0] epoch 0 validation accuracy" in out.stdout, out.stdout[-2000:]
    assert (tmp_path / "run" / "logs" / "rank-1.log").exists()
    assert netns_hosts.leftovers(hosts, wait=5) == {}


@_netns
def test_port_retry_and_environment_on_two_hosts(hosts, tmp_path):
    """Rank 0's port is taken on the first host: rank 0 fails with EADDRINUSE and the launcher
    starts again on another port. The --env variable reaches the remote ranks, a variable
    outside the allowlist does not."""
    script = write_script(tmp_path, TORCHRUN, "train.py")
    port = 20000 + os.getpid() % 10000
    listener = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            hosts.hosts[0].namespace,
            sys.executable,
            "-c",
            f"import socket,time\ns=socket.socket()\ns.bind(('',{port}))\ns.listen()\n"
            "print('listening',flush=True)\ntime.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout.readline().strip() == "listening"
        env = dict(os.environ, HPAR_MASTER_PORT=str(port), SECRET_FOR_TEST="leak")
        out = launch(
            "--hosts",
            _hosts_file(tmp_path, hosts),
            "--ssh-key",
            hosts.key,
            "--plain",
            "--env",
            "HPAR_MARK=7",
            "--run-dir",
            str(tmp_path / "run"),
            script,
            env=env,
            log=str(tmp_path / "o.txt"),
        )
    finally:
        listener.kill()
        listener.wait()
    assert out.returncode == 0, out.stdout[-3000:]
    assert f"rendezvous port {port} was taken (EADDRINUSE); starting again" in out.stdout, out.stdout[-3000:]
    assert "HPAR_MARK (--env)" in out.stdout and "SECRET_FOR_TEST" not in out.stdout
    assert f"[{hosts.addresses[1]} rank 1] rank 1/2 local 0/1 sum 3 args [] restart 0 mark 7 secret None" in out.stdout
    assert netns_hosts.leftovers(hosts, wait=5) == {}


@_netns
def test_sigkilled_rank_on_a_remote_host_leaves_nothing_within_10s(hosts, tmp_path):
    log = tmp_path / "o.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hpar.launcher.cli",
                "launch",
                "--hosts",
                _hosts_file(tmp_path, hosts),
                "--ssh-key",
                hosts.key,
                "--plain",
                "--run-dir",
                str(tmp_path / "run"),
                DDP,
                "--epochs",
                "1000",
                "--log-every",
                "1",
                "--step-sleep",
                "0.05",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
    try:
        assert wait_for(lambda: "rank 0] epoch 0 step 3 " in log.read_text(), 120), log.read_text()[-2000:]
        victims = []
        for pid in netns_hosts.testhosts.namespace_pids(hosts.hosts[1].namespace):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"ddp_digits.py" in cmdline and b"hpar.workers.guard" not in cmdline:
                victims.append(pid)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=60)
        assert proc.returncode == 1
        assert netns_hosts.leftovers(hosts, wait=10) == {}
        gone = time.monotonic() - killed
        text = log.read_text()
        assert f"rank 1 on {hosts.addresses[1]} failed: killed by SIGKILL" in text, text[-2000:]
        assert gone < 10, f"nothing may be left 10 s after the kill ({gone:.1f} s)"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_failure_report_shows_the_scripts_lines_not_hpars_protocol(tmp_path, reap_run):
    """A script that fails after the guard's heartbeats went into its log (a missing package,
    as `examples/ddp_digits.py` without scikit-learn): the report's last lines are the
    script's own, never an `@hpar heartbeat` line."""
    script = write_script(tmp_path, "import time\ntime.sleep(5)\nimport no_such_package_for_hpar\n", "train.py")
    run_dir = tmp_path / "run"
    reap_run(str(run_dir))
    out = launch("--gpus", "1", "--plain", "--run-dir", str(run_dir), script, log=str(tmp_path / "out.txt"))
    assert out.returncode == 1 and "No module named 'no_such_package_for_hpar'" in out.stdout, out.stdout[-3000:]
    assert "@hpar heartbeat" in (run_dir / "logs" / "rank-0.log").read_text()  # it was there to leak
    report = out.stdout[out.stdout.index("last lines of rank-0.log") :]
    assert "@hpar" not in report, report
