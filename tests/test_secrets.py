"""Secrets stay in memory (issue 61): ``--env`` values and the forwarded environment reach
processes on other hosts over the SSH channel's stdin or srun's own environment, never in argv
or a file; names that may hold credentials are forwarded only when named with ``--env``
(launcher/hosts/environ.py, launcher/procs/ssh.py, launcher/procs/srun.py)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
import subprocess
import sys
import threading
import time

import pytest

from support import netns_hosts
from support import slurm_cluster
from conftest import REPO, TINY, run_processes, wait_for, write_script
from hpar.launcher.hosts.environ import allowlisted, describe, forwarded, parse_env_flags
from hpar.launcher.procs.local import ProcessSpec
from hpar.launcher.procs.ssh import remote_command

PY = sys.executable
NAMES = ("HPAR_TEST_SECRET", "WANDB_API_KEY", "HF_TOKEN")
# what a process reports of NAMES: each one's digest, never its value
REPORT = """
import hashlib, os, sys
for name in NAMES:   # one write a line: the worker's heartbeat thread writes too
    value = os.environ.get(name)
    sys.stdout.write(f"env {name} {'absent' if value is None else hashlib.sha256(value.encode()).hexdigest()[:16]}\\n")
    sys.stdout.flush()
""".replace("NAMES", repr(NAMES))


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def _masked(text: str, values: dict) -> str:
    """``text`` with each of ``values`` replaced by its name (a failure never prints one)."""
    for name, value in values.items():
        text = text.replace(value, f"<{name}>")
    return text


def _files_holding(run_dir, values) -> list[str]:
    """Files under ``run_dir`` (every one, any size) that contain any of ``values``."""
    found = []
    for root, _, files in os.walk(run_dir):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                data = f.read()
            found += [f"{path}: {v[:6]}..." for v in values if v.encode() in data]
    return found


def test_credential_like_names_are_forwarded_only_with_env():
    from hpar.launcher.hosts.environ import credential_like

    environ = {
        "HF_TOKEN": "t1",
        "HF_HOME": "/hf",
        "HUGGINGFACE_HUB_TOKEN": "t2",
        "HUGGING_FACE_HUB_TOKEN": "t3",
        "WANDB_API_KEY": "k",
        "WANDB_PROJECT": "p",
        "MLFLOW_TRACKING_URI": "https://u:pw@m",
        "NCCL_DEBUG": "INFO",
        "HPAR_DB_PASSWORD": "pw",
        "TORCH_SECRET_THING": "s",
        "NCCL_IB_PKEY": "1",
        "GLOO_SOCKET_IFNAME": "eth0",
        "PYTHONPATH": "/p",
        "TOKENIZERS_PARALLELISM": "false",
        "HPAR_auth_token": "a",
        "AWS_SECRET_ACCESS_KEY": "no",
    }
    for name in (
        "HF_TOKEN",
        "HF_HOME",
        "WANDB_PROJECT",
        "MLFLOW_TRACKING_URI",
        "HPAR_DB_PASSWORD",
        "NCCL_IB_PKEY",
        "HPAR_auth_token",
        "MY_CREDENTIALS",
        "DB_PASSWD",
        "AWS_SECRET_ACCESS_KEY",
    ):
        assert credential_like(name), name
    for name in ("NCCL_DEBUG", "PYTHONPATH", "GLOO_SOCKET_IFNAME", "TORCH_LOGS", "HPAR_MASTER_PORT"):
        assert not credential_like(name), name
    assert set(allowlisted(environ)) == {"NCCL_DEBUG", "GLOO_SOCKET_IFNAME", "PYTHONPATH", "TOKENIZERS_PARALLELISM"}
    extra = parse_env_flags(("HF_TOKEN", "WANDB_API_KEY=other"), environ)
    sent = forwarded(extra, environ)
    assert sent["HF_TOKEN"] == "t1" and sent["WANDB_API_KEY"] == "other" and "HF_HOME" not in sent
    line = describe(extra, environ)
    shown, _, held = line.partition("; ")
    assert "HF_TOKEN (--env)" in shown and "WANDB_API_KEY (--env)" in shown and "NCCL_DEBUG" in shown
    assert "HF_HOME" not in shown and "HUGGINGFACE_HUB_TOKEN" not in shown and "MLFLOW" not in shown
    for name in (
        "HF_HOME",
        "HUGGINGFACE_HUB_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "MLFLOW_TRACKING_URI",
        "WANDB_PROJECT",
        "HPAR_DB_PASSWORD",
        "TORCH_SECRET_THING",
        "NCCL_IB_PKEY",
    ):
        assert name in held, (name, held)
    assert "AWS_SECRET_ACCESS_KEY" not in line  # never forwarded, not worth naming
    for value in ("t1", "t2", "/hf", "other", "pw", "https://u:pw@m"):
        assert value not in line.replace("HF_", "").split(": ", 1)[1].replace(",", " ").split()


def test_remote_environment_travels_on_stdin_and_the_rest_is_left(monkeypatch, tmp_path):
    """The remote command holds no value; the bootstrap reads exactly the first line of stdin
    (the environment), and the command it execs reads the rest (the guard's heartbeats)."""
    from hpar.launcher.procs.ssh import environment_line

    secret = "s3cr3t-" + secrets.token_hex(8)
    monkeypatch.setenv("HF_TOKEN", "hf-" + secret)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    code = (
        "import os,sys,json; print(json.dumps([os.environ.get(k) for k in ('S', 'HF_TOKEN', 'NCCL_DEBUG')] "
        "+ [sys.stdin.buffer.read().decode()]))"
    )
    spec = ProcessSpec("worker", 0, "h", (PY, "-c", code), {"S": secret + " $(id) '\n"})
    command = remote_command(spec, cwd=str(tmp_path))
    line = environment_line(spec)
    assert secret not in command and "hf-" not in command and "WARN" not in command
    assert line.endswith(b"\n") and line.count(b"\n") == 1 and b"hf-" not in line
    clean = {"PATH": os.environ["PATH"]}  # as sshd starts it: nothing of the launcher's environment
    out = subprocess.run(["bash", "-c", command], input=line + b"\n\nrest", capture_output=True, timeout=30, env=clean)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [secret + " $(id) '\n", None, "WARN", "\n\nrest"]
    out = subprocess.run(["bash", "-c", command], input=b'{"S": "x"}', capture_output=True, timeout=30, env=clean)
    assert out.returncode != 0 and b"environment" in out.stderr and not out.stdout
    with pytest.raises(ValueError, match="not an identifier"):
        environment_line(ProcessSpec("worker", 0, "h", (PY, "-c", "1"), {"A;touch x": "1"}))


def test_srun_task_file_holds_hpar_variables_only_and_is_private(tmp_path):
    from hpar.launcher.procs.srun_tasks import task_table, write_private

    secret = "s3cr3t-" + secrets.token_hex(8)
    step_env = {"HPAR_TEST_SECRET": secret, "OMP_NUM_THREADS": "2"}
    specs = [
        ProcessSpec("worker", r, "n1", (PY, "-m", "x"), {"RANK": str(r), "OMP_NUM_THREADS": "3", **step_env})
        for r in range(2)
    ]
    for spec in specs:
        spec.env["OMP_NUM_THREADS"] = "3"  # hpar's own value differs from the --env one: the task keeps it
    table = task_table(specs, step_env, "/w")
    assert [t["env"]["RANK"] for t in table] == ["0", "1"] and table[0]["argv"] == [PY, "-m", "x"]
    assert all(t["env"]["OMP_NUM_THREADS"] == "3" and "HPAR_TEST_SECRET" not in t["env"] for t in table)
    path = tmp_path / "srun-tasks.json"
    old = os.umask(0)
    try:
        write_private(str(path), json.dumps(table).encode())
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and secret not in path.read_text()
    assert os.listdir(tmp_path) == ["srun-tasks.json"]  # no temporary file left


# --- over SSH to test hosts whose commands run under dash -c ---------------------------------


@pytest.fixture(scope="module")
def dash_hosts():
    yield from netns_hosts.make_hosts(2, shell="dash")


def _ps_as_nobody() -> list[tuple[int, str]]:
    out = subprocess.run(
        ["runuser", "-u", "nobody", "--", "ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True, timeout=20
    ).stdout
    return [
        (int(pid), args) for pid, _, args in (line.strip().partition(" ") for line in out.splitlines()) if pid.isdigit()
    ]


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_ssh_run_shows_no_secret_in_any_argv_or_file(dash_hosts, tmp_path):
    """``hpar launch`` on two hosts whose sshd runs commands with ``dash -c`` (so its process
    keeps the command in argv for the whole run): polled with ``ps`` as nobody every 0.2 s, no
    process but the launcher itself (whose own argv has ``--env K=V``) shows a value; the ranks
    get the --env values and not the unnamed HF_TOKEN; no file under the run dir holds any."""
    values = {name: f"s3cr3t-{name[:2]}-{secrets.token_hex(8)}" for name in NAMES}
    script = write_script(tmp_path, REPORT + "import time\ntime.sleep(4)\n", "report.py")
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("".join(f"root@{a}:22 slots=1\n" for a in dash_hosts.addresses))
    run_dir, log = tmp_path / "run", tmp_path / "out.txt"
    env = dict(os.environ, HF_TOKEN=values["HF_TOKEN"], WANDB_API_KEY=values["WANDB_API_KEY"])
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                PY,
                "-m",
                "hpar.launcher.cli",
                "launch",
                "--hosts",
                str(hosts_file),
                "--ssh-key",
                dash_hosts.key,
                "--plain",
                "--env",
                f"HPAR_TEST_SECRET={values['HPAR_TEST_SECRET']}",
                "--env",
                "WANDB_API_KEY",
                "--run-dir",
                str(run_dir),
                script,
            ],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    leaks, seen = [], set()
    try:
        while proc.poll() is None:
            for pid, args in _ps_as_nobody():
                if pid != proc.pid and any(v in args for v in values.values()):
                    leaks.append(_masked(args, values)[:300])
                if "hpar.workers.guard" in args and "report.py" in args:
                    seen.add(pid)
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert seen, "the poll never saw a guard running: it checked nothing\n" + text[-3000:]
    assert not leaks, leaks[:3]
    for rank in (0, 1):
        for name in ("HPAR_TEST_SECRET", "WANDB_API_KEY"):
            assert f"rank {rank}] env {name} {_digest(values[name])}" in text, text[-2000:]
        assert f"rank {rank}] env HF_TOKEN absent" in text
    shown = [line for line in text.splitlines() if "environment forwarded to remote processes" in line]
    assert shown and all("HPAR_TEST_SECRET (--env)" in s and "WANDB_API_KEY (--env)" in s for s in shown), shown
    assert all("HF_TOKEN" not in s.partition("; ")[0] and "HF_TOKEN" in s.partition("; ")[2] for s in shown), shown
    assert not any(v in text for v in values.values())
    assert _files_holding(run_dir, values.values()) == []
    assert netns_hosts.leftovers(dash_hosts, wait=5) == {}


# --- inside an allocation of a real Slurm on this machine ------------------------------------


@pytest.fixture(scope="module")
def slurm():
    try:
        cluster = slurm_cluster.start()
    except slurm_cluster.Unavailable as exc:
        pytest.skip(f"no test Slurm: {exc}")
    try:
        yield cluster
    finally:
        slurm_cluster.stop(cluster)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_slurm_task_file_holds_no_env_value_and_goes(slurm, tmp_path):
    """``hpar run --env HPAR_TEST_SECRET=...`` in an allocation: the tasks get the value (srun's
    environment), HF_TOKEN (not named) stays behind, the task file is 0600 without the value
    whenever it is seen during the run and gone after it, and no file under the run dir holds a
    value."""
    values = {name: f"s3cr3t-{name[:2]}-{secrets.token_hex(8)}" for name in NAMES}
    script = write_script(tmp_path, REPORT + TINY)
    run_dir, log = tmp_path / "run", tmp_path / "out.txt"
    tasks = run_dir / "srun-tasks.json"
    env = slurm.env(HF_TOKEN=values["HF_TOKEN"])
    seen: list[tuple[int, bytes]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                with open(tasks, "rb") as f:
                    seen.append((stat.S_IMODE(os.fstat(f.fileno()).st_mode), f.read()))
            except OSError:
                pass
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with open(log, "w") as out:
            code = subprocess.run(
                [
                    "salloc",
                    "-N1",
                    "-n2",
                    PY,
                    "-m",
                    "hpar.launcher.cli",
                    "run",
                    script,
                    "--strategy",
                    "allreduce",
                    "--plain",
                    "--no-eval",
                    "--run-dir",
                    str(run_dir),
                    "--env",
                    f"HPAR_TEST_SECRET={values['HPAR_TEST_SECRET']}",
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=200,
                cwd=REPO,
            ).returncode
    finally:
        done.set()
        watcher.join()
    text = log.read_text()
    assert code == 0, text[-3000:]
    for rank in (0, 1):
        assert f"worker {rank}] env HPAR_TEST_SECRET {_digest(values['HPAR_TEST_SECRET'])}" in text, text[-3000:]
        assert f"worker {rank}] env HF_TOKEN absent" in text, text[-3000:]
    assert all(mode == 0o600 and values["HPAR_TEST_SECRET"].encode() not in data for mode, data in seen), [
        (oct(m), len(d)) for m, d in seen[:3]
    ]
    assert not tasks.exists()
    assert not any(v in text for v in values.values())
    assert _files_holding(run_dir, values.values()) == []
    assert wait_for(lambda: not run_processes(str(run_dir)), 10)
