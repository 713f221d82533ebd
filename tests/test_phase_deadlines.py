"""Deadlines outside the training steps, through the real `hpar run` (issue 51): with
--stall-timeout 5 a hanging evaluate() (before training, mid-run under --eval-every, after the
last step), a worker's first batch that never comes, and a parameter server that stops
answering are each ended within the timeout plus 5 s: exit 1, the stuck process named with
what it was doing, its stack in RUN_DIR/stacks, no process left. A slow evaluate() within a
longer --phase-timeout is no stall."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import TINY, embed_script, run_processes, wait_for, write_script

pytestmark = [pytest.mark.multiprocess]

STALL = 5.0
SHORT = TINY.replace('"steps": 20', '"steps": 6').replace('"log_every": 5', '"log_every": 2')

# hang(): what a dead collective or a stuck file system looks like from Python; the time it
# starts is written to MARK first (the clock of "ended within the timeout plus 5 s")
HANG = """
import os, time
def hang():
    with open(MARK, "w") as f:
        f.write(repr(time.time()))
    time.sleep(1000)
"""

# evaluate() hangs at its HANG_AT_CALL-th call on worker 0 (0: before training)
EVAL_HANG = SHORT.replace(
    "def evaluate(model):",
    HANG
    + """
CALLS = [0]
def evaluate(model):
    CALLS[0] += 1
    if CALLS[0] - 1 == HANG_AT_CALL:
        hang()""",
)

# worker 1 never delivers its first batch (the launcher's own check draws rank 0's only)
DATA_HANG = SHORT.replace(
    "def data(rank, world_size, batch_size):",
    HANG
    + """
def data(rank, world_size, batch_size):
    if rank == 1 and os.environ.get("RANK") == "1":
        hang()""",
)

# the servers replay the LR schedule (strategies/runtimes/hybrid/schedule.py): this one hangs there at step 2
SERVER_HANG = (
    embed_script(steps=8)
    + HANG
    + """
def scheduler(opt):
    def factor(step):
        if step == 2 and os.environ.get("HPAR_SERVER_INDEX") is not None:
            hang()
        return 1.0
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
"""
)


def run_until_stalled(tmp_path, text: str, *flags: str) -> tuple[int, str, str, float]:
    """`hpar run` on ``text`` with 2 workers, --stall-timeout 5 and ``flags`` until it ends;
    returns (exit code, output, run dir, seconds from the hang's start to the failure named
    and no process of the run left: the launcher's own interpreter exit is not counted)."""
    mark = str(tmp_path / "hang-started")
    script = write_script(tmp_path, text.replace("MARK", repr(mark)))
    run_dir = str(tmp_path / "run")
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out:
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
                "--stall-timeout",
                str(STALL),
                *flags,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_for(lambda: os.path.exists(mark) or proc.poll() is not None, 150)
        assert os.path.exists(mark), f"the hang never started: {out_path.read_text()}"
        ended = lambda: "failed: stalled" in out_path.read_text() and not run_processes(run_dir)
        assert wait_for(ended, 60, interval=0.05), out_path.read_text()
        elapsed = time.time() - float(open(mark).read())
        proc.wait(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, out_path.read_text(), run_dir, elapsed


def check_named(code: int, out: str, run_dir: str, elapsed: float, process: str, doing: str) -> None:
    """Exit 1, ``process`` named as stalled ``doing`` ..., its stack on file, ended in time."""
    assert code == 1, out
    failed = [line for line in out.splitlines() if line.startswith(f"hpar: {process} on localhost failed: stalled: ")]
    assert failed and failed[0].startswith(f"hpar: {process} on localhost failed: stalled: {doing}"), out
    assert "for more than 5 s (--stall-timeout)" in failed[0], out
    stack = os.path.join(run_dir, "stacks", process.replace(" ", "-") + ".txt")
    assert "in hang" in open(stack).read(), "the stuck process's own stack, where it hangs"
    assert json.load(open(os.path.join(run_dir, "summary.json")))["failed"] == process
    assert elapsed < STALL + 5, f"{elapsed:.1f} s from the hang to no process left"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "call, flags, doing",
    [
        (0, (), "in evaluate() before training"),
        (1, ("--eval-every", "2"), "in evaluate() after step 2"),
        (1, (), "in evaluate() after the last step"),
    ],
    ids=["before", "eval-every", "after"],
)
def test_a_hanging_evaluate_is_ended_within_the_timeout(tmp_path, reap_run, call, flags, doing):
    reap_run(str(tmp_path / "run"))
    code, out, run_dir, elapsed = run_until_stalled(
        tmp_path, EVAL_HANG.replace("HANG_AT_CALL", str(call)), "--strategy", "allreduce", *flags
    )
    check_named(code, out, run_dir, elapsed, "worker 0", doing)


@pytest.mark.timeout(240)
def test_a_first_batch_that_never_comes_is_ended_within_the_timeout(tmp_path, reap_run):
    reap_run(str(tmp_path / "run"))
    code, out, run_dir, elapsed = run_until_stalled(tmp_path, DATA_HANG, "--strategy", "allreduce", "--no-eval")
    check_named(code, out, run_dir, elapsed, "worker 1", "in data(), drawing its first batch")
    assert "worker 0: in torch" in out, "its peer waits for it in a collective"


@pytest.mark.timeout(240)
def test_a_server_that_stops_answering_is_ended_within_the_timeout(tmp_path, reap_run):
    reap_run(str(tmp_path / "run"))
    code, out, run_dir, elapsed = run_until_stalled(tmp_path, SERVER_HANG, "--strategy", "hybrid", "--no-eval")
    check_named(code, out, run_dir, elapsed, "server 0", "handling worker")


def test_health_names_the_overdue_process_and_its_waiting_peers_do_not_stall(monkeypatch):
    """launcher/run/health.py with a fake clock: a worker busy past --phase-timeout is overdue
    (before its peers, whose step clocks stand still meanwhile), a shorter activity is not, and
    a process still short of the rendezvous after the start-up bound has stalled."""
    from hpar.launcher.run import health

    clock = [1000.0]
    monkeypatch.setattr(health.time, "monotonic", lambda: clock[0])
    h = health.Health(
        ["w0", "w1", "s0"], ["worker", "worker", "server"], total_steps=100, stall_timeout=5, phase_timeout=20
    )
    beat = lambda key, **payload: (h.line(key), h.heartbeat(key, {"at_step": 3, **payload}))
    for key in ("w0", "w1", "s0"):
        beat(key)
        h.phase(key, "serve" if key == "s0" else "train")
    clock[0] += 1
    beat("w0", doing="writing the checkpoint of step 3 (worker0.pt)", doing_s=0.5)
    for _ in range(15):  # 15 s: past the stall timeout, within the phase timeout; w1 and s0 wait
        clock[0] += 1
        beat("w1"), beat("s0")
        beat("w0", doing="writing the checkpoint of step 3 (worker0.pt)", doing_s=clock[0] - 1000.5)
    assert h.stalled(["w0", "w1", "s0"]) == []
    clock[0] += 6
    beat("w1"), beat("s0")
    h.line("w0")
    assert h.stalled(["w0", "w1", "s0"]) == [
        ("w0", "stalled: writing the checkpoint of step 3 (worker0.pt) for more than 20 s (--phase-timeout)")
    ]
    h.activity("w0", None)  # the write ended: the peers' step clocks start again from now
    clock[0] += 4
    for key in ("w0", "w1", "s0"):
        beat(key)
    assert h.stalled(["w0", "w1", "s0"]) == []
    # a server stuck in one request: the workers wait for its answer and are not named; the
    # server is, once its deadline passes
    srv = health.Health(["w0", "s0"], ["worker", "server"], total_steps=100, stall_timeout=5)
    srv.line("w0"), srv.heartbeat("w0", {"at_step": 3}), srv.phase("w0", "train")
    srv.line("s0"), srv.heartbeat("s0", {}), srv.phase("s0", "serve")
    clock[0] += 0.2
    srv.heartbeat("s0", {"doing": "handling worker 0's push of emb.weight (step 4)", "doing_s": 0.1})
    clock[0] += 5.3  # the worker's step clock past 5 s, the server busy for 5.4 s
    srv.line("w0"), srv.heartbeat("w0", {"at_step": 3})
    srv.line("s0"), srv.heartbeat("s0", {"doing": "handling worker 0's push of emb.weight (step 4)", "doing_s": 5.4})
    assert srv.stalled(["w0", "s0"]) == [
        ("s0", "stalled: handling worker 0's push of emb.weight (step 4) for more than 5 s (--stall-timeout)")
    ]
    late = health.Health(["w0"], ["worker"], total_steps=10, stall_timeout=5)
    late.line("w0"), late.heartbeat("w0", {"at_step": 0})
    clock[0] += 119
    late.line("w0"), late.heartbeat("w0", {"at_step": 0})
    assert late.stalled(["w0"]) == []
    clock[0] += 2
    late.line("w0"), late.heartbeat("w0", {"at_step": 0})
    assert late.stalled(["w0"]) == [("w0", "stalled: not at the rendezvous within 120 s of its start")]
