"""Reliability through the real `hpar run` (issue 18): resume after the final checkpoint,
damaged checkpoints, the stalled rank named with its stack and everything gone within
stall-timeout + 5 s, start-up and evaluate not taken for stalls, early exits named, processes
in new sessions stopped, one-line errors for bad input. (SSH host keys: test_host_keys.py; the
stall diagnosis without a run: test_stall_blame.py.)"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import TINY, embed_script, hpar, hpar_to_file, run_processes, wait_for, write_script, final_state

pytestmark = [pytest.mark.multiprocess]

SHORT = TINY.replace('"steps": 20', '"steps": 6').replace('"log_every": 5', '"log_every": 2')

# rank 1 hangs in data() at its 30th batch (alive: its heartbeats go on), or a test SIGSTOPs it
HANG = (
    TINY.replace('HPAR = {"steps": 20', 'import os, time\nHPAR = {"steps": 100000')
    .replace('"log_every": 5', '"log_every": 2')
    .replace(
        "    for _ in range(10_000):\n",
        "    for n in range(10_000):\n        time.sleep(0.05)\n"
        "        if rank == 1 and n == HANG_AT:\n            time.sleep(1000)\n",
    )
)


def run_cli(tmp_path, *args, name="out.txt", timeout=180):
    """`hpar ARGS` with stdout and stderr to a file; returns (exit code, output)."""
    return hpar_to_file(tmp_path / name, *args, timeout=timeout)


def state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_resume_after_the_final_checkpoint_and_from_a_damaged_one(tmp_path, reap_run):
    script = write_script(tmp_path, SHORT)
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    code, out = run_cli(
        tmp_path,
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "allreduce",
        "--checkpoint-every",
        "3",
        "--run-dir",
        run_dir,
        "--plain",
        name="first.txt",
    )
    assert code == 0, out
    first = json.load(open(os.path.join(run_dir, "summary.json")))
    model = final_state(run_dir)
    junk = os.path.join(run_dir, "checkpoints", ".tmp-k1lled_x")  # mkstemp's shape: ".tmp-" and 8 characters
    open(junk, "wb").write(b"x" * 1000)

    # 1. resume a run that ended with its final checkpoint: nothing left to train, same result
    code, out = run_cli(tmp_path, "run", "--resume", run_dir, "--plain", name="resume.txt")
    assert code == 0, out
    assert out.startswith("hpar: nothing to do: the run finished at step 6: "), out
    assert "loss -" not in out and "nan" not in out, out
    again = json.load(open(os.path.join(run_dir, "summary.json")))
    for key in ("loss_first", "loss_last", "eval_first", "eval_last"):
        assert again[key] == first[key], key
    assert state_equal(final_state(run_dir), model)
    assert not os.path.exists(junk), "temp files left by a fault are removed at the next start"

    # 2. killed after its last checkpoint, before its final model (so not finished), and the newest
    # checkpoint is truncated: its checksum fails, resume falls back to step 3
    shutil.rmtree(os.path.join(run_dir, "model"))
    part = os.path.join(
        run_dir, "checkpoints", "step-6", "__0_0.distcp"
    )  # worker 0's file (torch.distributed.checkpoint)
    data = open(part, "rb").read()
    open(part, "wb").write(data[: len(data) - 10])
    code, out = run_cli(tmp_path, "run", "--resume", run_dir, "--plain", name="fallback.txt")
    assert code == 0, out
    assert f"{part}: checksum mismatch" in out and "previous complete checkpoint, step 3" in out, out
    resumed = json.load(open(os.path.join(run_dir, "summary.json")))
    assert state_equal(final_state(run_dir), model), "resume equals the uninterrupted run"
    assert resumed["loss_first"] == first["loss_first"] and resumed["eval_first"] == first["eval_first"]
    assert resumed["loss_last"] == first["loss_last"]
    assert not run_processes(run_dir)

    # 3. a flag that cannot hold for the resumed run: one line, exit 2, nothing touched
    latest = open(os.path.join(run_dir, "checkpoints", "latest")).read()
    code, out = run_cli(tmp_path, "run", "--resume", run_dir, "--gpus", "0", "--plain", name="refused.txt")
    assert code == 2, out
    assert out.splitlines()[-1] == "hpar: --gpus must be at least 1, got 0", out
    assert open(os.path.join(run_dir, "checkpoints", "latest")).read() == latest
    assert state_equal(final_state(run_dir), model)


@pytest.mark.timeout(300)
def test_hybrid_resume_after_the_final_checkpoint(tmp_path, reap_run):
    script = write_script(tmp_path, embed_script(steps=4))
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    code, out = run_cli(
        tmp_path,
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "hybrid",
        "--checkpoint-every",
        "2",
        "--run-dir",
        run_dir,
        "--plain",
        name="first.txt",
    )
    assert code == 0, out
    first = json.load(open(os.path.join(run_dir, "summary.json")))
    model = final_state(run_dir)
    # no --plan: the server cut the 1000-row table into ROW_PARTITIONS_PER_SERVER (64) partitions,
    # written as one ShardedTensor of the table's shape with a shard per partition
    from torch.distributed.checkpoint import FileSystemReader
    from hpar.strategies.state.checkpoint import step_dir

    table = FileSystemReader(step_dir(run_dir, 4)).read_metadata().state_dict_metadata["model.emb.weight"]
    assert tuple(table.size) == (1000, 8) and len(table.chunks) == 64
    shutil.rmtree(os.path.join(run_dir, "model"))  # killed after its final checkpoint: resumed at its last step
    code, out = run_cli(tmp_path, "run", "--resume", run_dir, "--plain", name="resume.txt")
    assert code == 0, out
    assert "Traceback" not in out
    again = json.load(open(os.path.join(run_dir, "summary.json")))
    assert (
        again["exit_code"] == 0
        and again["loss_first"] == first["loss_first"]
        and again["loss_last"] == first["loss_last"]
    )
    assert state_equal(final_state(run_dir), model)


def _worker_pid(run_dir: str, rank: int) -> int:
    for p in run_processes(run_dir):
        if p.cmdline()[1:3] == ["-m", "hpar.workers.worker"] and p.environ().get("RANK") == str(rank):
            return p.pid
    raise AssertionError("worker not found")


def _start_hanging(tmp_path, hang_at: int, stall: float):
    script = write_script(tmp_path, HANG.replace("HANG_AT", str(hang_at)))
    run_dir = str(tmp_path / "run")
    out = open(tmp_path / "out.txt", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpar.launcher.cli",
            "run",
            script,
            "--gpus",
            "2",
            "--strategy",
            "allreduce",
            "--run-dir",
            run_dir,
            "--plain",
            "--no-eval",
            "--stall-timeout",
            str(stall),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    return proc, run_dir


@pytest.mark.timeout(200)
def test_sigstopped_worker_is_named_and_everything_ends_within_stall_timeout_plus_5s(tmp_path, reap_run):
    stall = 5.0
    proc, run_dir = _start_hanging(tmp_path, hang_at=10**9, stall=stall)
    reap_run(run_dir)
    try:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        assert wait_for(lambda: os.path.exists(metrics) and open(metrics).read().count('"kind":"metric"') >= 6, 120)
        os.kill(_worker_pid(run_dir, 1), signal.SIGSTOP)
        stopped = time.monotonic()
        # the launcher's own interpreter exit is not counted (seconds under heavy load): the
        # failure named and every process of the run gone are
        named = lambda: "failed: stalled" in (tmp_path / "out.txt").read_text() and not run_processes(run_dir)
        assert wait_for(named, 60, interval=0.05)
        elapsed = time.monotonic() - stopped
        proc.wait(timeout=60)
    finally:
        proc.kill()
    out = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 1, out
    assert "worker 1 on localhost failed: stalled: silent for" in out, out
    assert "worker 0 on localhost failed" not in out
    assert "worker 1: no stack (stopped" in out, out
    assert "worker 0: in torch" in out, "the peer's stack says it waits in torch"
    assert os.path.exists(os.path.join(run_dir, "stacks", "worker-0.txt"))
    assert elapsed < stall + 5, f"{elapsed:.1f} s from SIGSTOP to no process left"
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["failed"] == "worker 1"


@pytest.mark.timeout(200)
def test_rank_hanging_in_user_code_is_named_with_its_stack(tmp_path, reap_run):
    proc, run_dir = _start_hanging(tmp_path, hang_at=25, stall=4.0)
    reap_run(run_dir)
    try:
        proc.wait(timeout=150)
    finally:
        proc.kill()
    out = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 1, out
    assert "worker 1 on localhost failed: stalled: not in a collective while its peers wait in one" in out, out
    assert "worker 1: elsewhere: data (job.py:" in out, out
    stack = open(os.path.join(run_dir, "stacks", "worker-1.txt")).read()
    assert "job.py" in stack and "in data" in stack
    assert not run_processes(run_dir)


@pytest.mark.timeout(200)
def test_ctrl_c_on_a_hung_run_prints_every_stack_first(tmp_path, reap_run):
    proc, run_dir = _start_hanging(tmp_path, hang_at=25, stall=0)
    reap_run(run_dir)
    try:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        steps = lambda: open(metrics).read().count('"kind":"metric"') if os.path.exists(metrics) else 0
        assert wait_for(lambda: steps() >= 20, 120)  # rank 1 hangs after 25 batches (one was the check)
        count, since = steps(), time.monotonic()
        while time.monotonic() - since < 7:  # no new step for 7 s: hung
            time.sleep(0.5)
            if steps() != count:
                count, since = steps(), time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    out = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 130, out
    assert "SIGINT received" in out and "worker 1: elsewhere: data (job.py:" in out, out
    assert not run_processes(run_dir)


SLOW_START = SHORT.replace("def evaluate(model):", "def evaluate(model):\n    import time; time.sleep(4)").replace(
    "        yield x, x.sum(1, keepdim=True)",
    "        x = x[:6] if rank == 1 else x\n        yield x, x.sum(1, keepdim=True)",
)


@pytest.mark.timeout(200)
def test_startup_and_evaluate_are_not_stalls_and_unequal_batches_are_named(tmp_path, reap_run):
    # --stall-timeout 2: start-up (importing torch, joining the group) and a 4 s evaluate() both
    # take longer than that; neither is a step stall, and --phase-timeout 60 gives evaluate() its
    # time. Rank 1 draws 6 samples, rank 0 8: --allow-unequal-batches trains them, warned once.
    script = write_script(tmp_path, SLOW_START)
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    code, out = run_cli(
        tmp_path,
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "allreduce",
        "--run-dir",
        run_dir,
        "--plain",
        "--stall-timeout",
        "2",
        "--phase-timeout",
        "60",
        "--allow-unequal-batches",
    )
    assert code == 0, out
    assert out.count("workers draw batches of different sizes (worker 0: 8, worker 1: 6)") == 1, out
    assert not run_processes(run_dir)


EARLY_EXIT = (
    SHORT.replace('"steps": 6', '"steps": 1000')
    .replace(
        "def model():",
        """def model():
    import os, subprocess
    if os.environ.get("RANK") == "0":   # a helper in a session of its own, as some user code starts
        subprocess.Popen(["sleep", "1000"], start_new_session=True)
    return _model()
def _model():""",
    )
    .replace(
        "        yield x, x.sum(1, keepdim=True)",
        """        if rank == 1 and _ == 5:
            import sys; sys.exit(0)
        yield x, x.sum(1, keepdim=True)""",
    )
)


@pytest.mark.timeout(200)
def test_worker_exiting_0_early_is_named_and_new_session_children_are_stopped(tmp_path, reap_run):
    script = write_script(tmp_path, EARLY_EXIT)
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)  # finds the `sleep` too (it inherits HPAR_CONFIG)
    code, out = run_cli(
        tmp_path, "run", script, "--gpus", "2", "--strategy", "allreduce", "--run-dir", run_dir, "--plain", "--no-eval"
    )
    assert code == 1, out
    assert "worker 1 on localhost failed: exited with code 0 before the end of training" in out, out
    assert wait_for(lambda: not run_processes(run_dir), 10), [p.cmdline() for p in run_processes(run_dir)]


@pytest.mark.parametrize(
    "body, code, announced, stderr",
    [
        ("return 0", 0, True, ""),
        ("sys.exit(0)", 0, False, ""),
        ("sys.exit()", 0, False, ""),
        ("sys.exit(3)", 3, False, ""),
        ("sys.exit('bye')", 1, False, "bye"),
    ],
    ids=["returns-0", "exit-0", "exit-none", "exit-3", "exit-message"],
)
def test_a_sys_exit_in_the_users_code_ends_the_worker_with_its_code_unannounced(body, code, announced, stderr):
    """workers/worker.run_entry: a SystemExit out of the worker's main (the user's ``sys.exit()``
    mid-training) ends the process at once with its code and no ``exit`` event, so the launcher
    reports an early exit; through interpreter finalization, with gloo's threads alive, it
    aborted now and then (SIGABRT) and the launcher reported a crash instead."""
    prog = (
        "import atexit, sys\nfrom hpar.workers.worker import run_entry\n"
        "atexit.register(lambda: print('finalized', flush=True))\n"
        f"def main():\n    {body}\nrun_entry(main, 'hpar', ())\n"
    )
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=120)
    assert out.returncode == code, out.stderr
    assert "finalized" not in out.stdout  # ended at once, as a finished worker does (report.exit_process)
    from hpar.workers.report import parse

    events = [parse(line) for line in out.stdout.splitlines()]
    assert (("event", {"kind": "exit", "code": 0}) in events) == announced, out.stdout
    assert stderr in out.stderr


@pytest.mark.parametrize(
    "text, args, message",
    [
        ("import sys\nsys.exit(0)\n", (), "the script called sys.exit(0) while being imported"),
        (
            SHORT.replace("x = torch.randn(batch_size, 4, generator=g)", "x = torch.empty(batch_size, 1 << 40)"),
            ("--batch-size", "100000"),
            "data() raised RuntimeError while producing a batch",
        ),
        (
            SHORT.replace("    g = torch.Generator", "    raise KeyError('shard')\n    g = torch.Generator"),
            (),
            "data() raised KeyError while producing a batch: 'shard'",
        ),
    ],
    ids=["sys-exit-at-import", "huge-batch", "data-raises"],
)
def test_bad_scripts_are_one_line_and_exit_2(tmp_path, text, args, message):
    script = write_script(tmp_path, text)
    res = hpar("run", script, "--run-dir", str(tmp_path / "run"), *args)
    assert res.returncode == 2, res.stdout + res.stderr
    first = res.stderr.splitlines()[0]
    assert first.startswith(f"hpar: {script}") and message in first, first  # FILE: or FILE:LINE:
    assert not (tmp_path / "run").exists()


def test_run_dir_that_is_a_file_and_malformed_plan_stages(tmp_path):
    script = write_script(tmp_path, SHORT)
    (tmp_path / "taken").write_text("a file")
    res = hpar("run", script, "--run-dir", str(tmp_path / "taken"))
    assert res.returncode == 2
    assert (
        res.stderr.splitlines()[0]
        == f"hpar: --run-dir {tmp_path / 'taken'}: is a file, not a directory; pick a new directory name"
    )
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"strategy": "pipeline", "stages": [[0, "x"], [3, 5]]}))
    res = hpar("run", script, "--gpus", "2", "--plan", str(plan), "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith(f"hpar: {plan}: 'stages' must be a list of [start, end] layer index pairs")
    plan.write_text(json.dumps({"strategy": "pipeline", "stages": [[0, 2], [3, 5]]}))
    res = hpar("run", script, "--gpus", "2", "--plan", str(plan), "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 2 and res.stderr.startswith(f"hpar: {plan}: plan stages"), res.stderr
    assert not (tmp_path / "run").exists()
