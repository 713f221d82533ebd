"""A worker or server killed mid-run, Ctrl-C, the launcher itself killed, and --max-restarts:
the exit code and message are right and nothing of the run is left."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import TINY, embed_script, run_processes, wait_for, write_script, final_state

pytestmark = [pytest.mark.multiprocess]

SLOW = (
    TINY.replace('HPAR = {"steps": 20', 'import time\nHPAR = {"steps": 100000')
    .replace("yield x, x.sum(1, keepdim=True)", "time.sleep(0.05)\n        yield x, x.sum(1, keepdim=True)")
    .replace('"log_every": 5', '"log_every": 2')
)


@contextlib.contextmanager
def running(tmp_path, text: str, *flags: str, progress: int = 4):
    """Start ``hpar run`` on ``text`` with 2 workers and ``flags``; yield (launcher, run dir)
    once ``progress`` metric lines are in; afterwards kill whatever is left of the run."""
    script = write_script(tmp_path, text)
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpar.launcher.cli",
            "run",
            script,
            "--gpus",
            "2",
            "--run-dir",
            run_dir,
            "--plain",
            "--no-eval",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        ok = wait_for(lambda: os.path.exists(metrics) and open(metrics).read().count('"kind":"metric"') >= progress, 90)
        assert ok, "the run never made progress"
        yield proc, run_dir
    finally:
        proc.kill()
        for p in run_processes(run_dir):
            p.kill()


def process_of(run_dir: str, module: str, rank: int | None = None):
    """The process running ``python -m module`` of the run (not the guard above it)."""
    for p in run_processes(run_dir):
        if p.cmdline()[1:3] == ["-m", module] and (rank is None or p.environ().get("RANK") == str(rank)):
            return p
    raise AssertionError(f"no {module} process found")


@pytest.mark.timeout(150)
def test_sigkill_worker_stops_everything(tmp_path):
    with running(tmp_path, SLOW, "--strategy", "allreduce") as (proc, run_dir):
        process_of(run_dir, "hpar.workers.worker", rank=1).kill()
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        assert wait_for(lambda: not run_processes(run_dir), 10), "processes left after the failure"
        assert time.monotonic() - killed < 10 + 3
        assert proc.returncode == 1
        assert "worker 1 on localhost failed: killed by SIGKILL" in out
        assert "last lines of worker-1.log" in out or "worker-1.log holds no line of the process's own" in out, out


@pytest.mark.timeout(150)
def test_sigkill_server_stops_everything(tmp_path):
    with running(tmp_path, embed_script(steps=100000, sleep=0.05), "--strategy", "hybrid") as (proc, run_dir):
        process_of(run_dir, "hpar.workers.server").kill()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 1
        assert "server 0 on localhost failed: killed by SIGKILL" in out
        assert wait_for(lambda: not run_processes(run_dir), 10)


@pytest.mark.timeout(240)
def test_ctrl_c_stops_cleanly_and_says_how_to_resume(tmp_path):
    """Ctrl-C: exit 130, nothing left, and a last line naming the step reached, the last
    complete checkpoint and the resume command, which, run as printed, resumes from it."""
    with running(tmp_path, SLOW, "--strategy", "allreduce", "--checkpoint-every", "2", progress=6) as (proc, run_dir):
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130
        assert "SIGINT received" in out
        assert not run_processes(run_dir)
        assert json.load(open(os.path.join(run_dir, "summary.json")))["exit_code"] == 130
    from hpar.strategies.state.checkpoint import latest_step

    saved = latest_step(run_dir)
    last = out.rstrip().splitlines()[-1]
    assert saved and last.startswith("hpar: interrupted (Ctrl-C) at step "), out[-2000:]
    assert last.endswith(
        f"; run dir {run_dir}; last complete checkpoint: step {saved}; resume with: hpar run --resume {run_dir}"
    ), last
    command = last.split("resume with: ")[1].split() + ["--steps", str(saved + 2), "--plain", "--no-eval"]
    assert command[:3] == ["hpar", "run", "--resume"]
    done = subprocess.run(
        [sys.executable, "-m", "hpar.launcher.cli", *command[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0 and not run_processes(run_dir), done.stdout[-2000:]
    assert f"hpar: resuming {run_dir} from its checkpoint of step {saved}" in done.stdout, done.stdout[-2000:]
    assert f"step {saved + 2}/{saved + 2}" in done.stdout
    # the final line's figures span the run: its step-1 loss (not the resumed segment's first) to the last
    first = json.load(open(os.path.join(run_dir, "first.json")))["loss_first"]
    final = done.stdout.rstrip().splitlines()[-1]
    assert final.startswith("hpar: done: ") and f"training loss {first:.4f} -> " in final, final
    assert "(step 1, and the mean of the last 2 steps)" in final, final


@pytest.mark.timeout(150)
def test_ctrl_c_while_profiling_exits_130_with_hpars_line(tmp_path):
    """Ctrl-C before any process started (the script's data() is being drawn to profile it):
    hpar's line, not click's "Aborted!", exit 130, and no run directory left behind."""
    marker = tmp_path / "drawing"
    text = SLOW.replace("time.sleep(0.05)", f"open({str(marker)!r}, 'w').close(); time.sleep(0.5)")
    script = write_script(tmp_path, text)
    for command in (["run", script, "--gpus", "2", "--run-dir", str(tmp_path / "run")], ["profile", script]):
        marker.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpar.launcher.cli", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert wait_for(marker.exists, 90), "profiling never drew a batch"
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=30)
        finally:
            proc.kill()
        # a test process starved past the profile (once in CI) signals --tune's first trial instead
        late = "hpar: --tune: a " in out
        assert proc.returncode == 130, out
        said = ("hpar: interrupted (Ctrl-C) during --tune's trial of ",) if late else ()
        said += ("hpar: interrupted (Ctrl-C) while ",)  # (before a trial started, planning still)
        assert any(x in out for x in said) and "Aborted" not in out and "Traceback" not in out, out
        assert late or not (tmp_path / "run").exists(), out


@pytest.mark.timeout(200)
def test_ctrl_c_during_a_tune_trial_stops_hpar_and_starts_no_run(tmp_path):
    """Ctrl-C while --tune's first trial trains: hpar's line naming the trial, exit 130, no other
    trial and no run started, no process left (a CI run sent it there once and hpar went on to
    the next trial and the run, taking the trial's 130 for a failure)."""
    marker = tmp_path / "drawing"
    script = write_script(
        tmp_path, SLOW.replace("time.sleep(0.05)", f"open({str(marker)!r}, 'w').close(); time.sleep(0.5)")
    )
    run_dir = tmp_path / "run"
    command = ["run", script, "--gpus", "2", "--run-dir", str(run_dir), "--tune", "on", "--plain"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpar.launcher.cli", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    before = []
    try:
        for line in proc.stdout:
            before.append(line)
            if line.startswith("hpar: --tune: a "):  # profiling's draws are over: the next is a trial's
                break
        trials = lambda: [str(d) for d in (run_dir / "trials").glob("*/run")]  # noqa: E731
        assert wait_for(lambda: any(run_processes(d) for d in trials()), 90), "no trial started:\n" + "".join(before)
        marker.unlink(missing_ok=True)  # the launcher's own check of the script drew one too
        assert wait_for(marker.exists, 90), "no trial drew a batch:\n" + "".join(before)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    out = "".join(before) + out
    assert proc.returncode == 130, out
    assert "hpar: interrupted (Ctrl-C) during --tune's trial of " in out and "Traceback" not in out, out
    assert "hpar: trial " not in out and "--tune chose" not in out, out  # no other trial, no choice
    assert not (run_dir / "summary.json").exists() and len(trials()) == 1, out
    assert not any(run_processes(d) for d in [str(run_dir), *trials()]), out


@pytest.mark.timeout(150)
def test_launcher_sigkill_leaves_nothing(tmp_path):
    with running(tmp_path, SLOW, "--strategy", "allreduce") as (proc, run_dir):
        proc.kill()  # SIGKILL: no handler runs; the guards notice their closed stdin
        proc.wait()
        assert wait_for(lambda: not run_processes(run_dir), 10), "workers outlived the launcher"


@pytest.mark.timeout(200)
def test_max_restarts_resumes_and_finishes(tmp_path):
    from conftest import single_process_reference
    from test_allreduce import assert_close_state

    text = SLOW.replace('"steps": 100000', '"steps": 40')
    with running(
        tmp_path, text, "--strategy", "allreduce", "--checkpoint-every", "5", "--max-restarts", "1", progress=0
    ) as (proc, run_dir):
        latest = os.path.join(run_dir, "checkpoints", "latest")
        assert wait_for(lambda: os.path.exists(latest) and int(open(latest).read()) >= 10, 90)
        process_of(run_dir, "hpar.workers.worker", rank=1).kill()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "worker 1 on localhost failed: killed by SIGKILL" in out
        assert "restart 1/1 from step" in out
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
        assert summary["exit_code"] == 0 and summary["restarts"] == 1
        got = final_state(run_dir)
        assert_close_state(got, single_process_reference(os.path.join(str(tmp_path), "job.py"), 2, 40, 8, 0.1, 0))
        assert not run_processes(run_dir)
