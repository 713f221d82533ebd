"""What happens around the training loop, through the real `hpar run` (issue 51): a helper the
script starts in a session of its own, in the launcher's checks and in every worker, is gone
when hpar exits, whether the run finishes or fails, and hpar names what it ended; first batches
that break exactness (sizes that differ between workers, or that a pipeline's micro-batches do
not divide) are refused before training in one line, exit 2."""

import json
import os

import psutil
import pytest

from conftest import TINY, embed_script, hpar_to_file, run_processes, wait_for, write_script

pytestmark = [pytest.mark.multiprocess]

SHORT = TINY.replace('"steps": 20', '"steps": 6').replace('"log_every": 5', '"log_every": 2')

# every call of data() (the launcher's checks, each worker) starts a helper in a session of its
# own, as some data loaders and tokenizer servers do, and records its pid in PIDS
ESCAPING = SHORT.replace(
    "def data(rank, world_size, batch_size):",
    """import os, subprocess, sys
def data(rank, world_size, batch_size):
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "hpar-test-helper"],
                              start_new_session=True)
    open(os.path.join(PIDS, str(helper.pid)), "w").close()
    if rank == 1 and os.environ.get("RANK") == "1" and FAIL:
        raise RuntimeError("worker 1 fails after starting its helper")""",
)


def helpers_alive(pid_dir) -> list[int]:
    """The recorded helpers that still run (by pid, checked to be the helper: pids are reused)."""
    alive = []
    for name in os.listdir(pid_dir):
        try:
            p = psutil.Process(int(name))
            if p.status() != psutil.STATUS_ZOMBIE and "hpar-test-helper" in p.cmdline():
                alive.append(p.pid)
        except psutil.Error:
            continue
    return alive


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fail", [False, True], ids=["finishes", "fails"])
def test_helpers_in_sessions_of_their_own_end_with_the_run(tmp_path, reap_run, fail):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = write_script(tmp_path, ESCAPING.replace("PIDS", repr(str(pid_dir))).replace("FAIL", str(fail)))
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    try:
        code, out = hpar_to_file(
            tmp_path / "out.txt",
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
        )
        left = helpers_alive(pid_dir)
    finally:
        for pid in helpers_alive(pid_dir):
            psutil.Process(pid).kill()
    assert code == (1 if fail else 0), out
    assert len(os.listdir(pid_dir)) >= 3, "the launcher's check and both workers started one"
    assert left == [], f"helpers outlived hpar: {left}\n{out}"
    lines = [line for line in out.splitlines() if line.startswith("hpar: ended ")]
    assert len(lines) == 2, out
    assert "; started by worker 0: " in lines[0] and "; started by worker 1: " in lines[0], out
    assert "started by the script in the launcher (its checks, the profile): " in lines[1], out
    assert "hpar-test-helper" in lines[1], out
    if fail:
        assert "hpar: worker 1 on localhost failed: exit code" in out, out
    assert wait_for(lambda: not run_processes(run_dir), 10)


# rank 1's batches are one sample short (as a data() that splits a dataset unevenly)
UNEQUAL = SHORT.replace(
    "x = torch.randn(batch_size, 4, generator=g)", "x = torch.randn(batch_size - rank, 4, generator=g)"
)
UNEQUAL_EMBED = embed_script(steps=4).replace(
    "torch.randint(0, 1000, (batch_size,), generator=g), torch.randn(batch_size, generator=g)",
    "torch.randint(0, 1000, (batch_size - rank,), generator=g), torch.randn(batch_size - rank, generator=g)",
)
# 6 samples where 4 micro-batches were planned for 8 (the launcher's own check draws 8)
SHORT_BATCH = SHORT.replace(
    "x = torch.randn(batch_size, 4, generator=g)",
    "x = torch.randn(6 if os.environ.get('RANK') else batch_size, 4, generator=g)",
).replace("import torch, torch.nn as nn", "import os, torch, torch.nn as nn")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "text, flags, line",
    [
        (
            UNEQUAL,
            ("--strategy", "allreduce"),
            "hpar: workers' first batches differ in size (worker 0: 8, worker 1: 7 samples): "
            "gradients are averaged per worker, so this is not one process on the concatenated batch; make data(rank, "
            "world_size, batch_size) yield 8 samples on every rank, or pass --allow-unequal-batches to train so (each "
            "worker's mean gradient weighs the same, as DDP does)",
        ),
        (
            UNEQUAL_EMBED,
            ("--strategy", "hybrid"),
            "hpar: workers' first batches differ in size (worker 0: 4, worker 1: 3 samples)",
        ),
        (
            SHORT_BATCH,
            ("--strategy", "pipeline", "--micro-batches", "4"),
            "hpar: first batches that --micro-batches 4 does "
            "not divide (worker 0: 6, worker 1: 6 samples): make data() yield --batch-size (8) samples, or choose "
            "--micro-batches that divides them",
        ),
    ],
    ids=["allreduce", "hybrid", "pipeline"],
)
def test_first_batches_that_break_exactness_are_refused_in_one_line(tmp_path, reap_run, text, flags, line):
    script = write_script(tmp_path, text)
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    code, out = hpar_to_file(
        tmp_path / "out.txt",
        "run",
        script,
        "--gpus",
        "2",
        "--run-dir",
        run_dir,
        "--plain",
        "--no-eval",
        "--max-restarts",
        "2",
        *flags,
    )
    assert code == 2, out
    refused = [l for l in out.splitlines() if "first batches" in l]
    assert len(refused) == 1 and refused[0].startswith(line), out  # once, from the launcher: not per worker
    assert "Traceback" not in out and "restart" not in out, "refused, not crashed, and no restart can help"
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["exit_code"] == 2 and summary["steps"] == 0, summary  # before any step
    assert not os.path.exists(os.path.join(run_dir, "model"))
    assert wait_for(lambda: not run_processes(run_dir), 10)


@pytest.mark.timeout(300)
def test_resuming_a_finished_run_says_so_with_its_own_figures(tmp_path, reap_run):
    script = write_script(tmp_path, SHORT)
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    code, out = hpar_to_file(
        tmp_path / "first.txt",
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
    )
    assert code == 0, out
    done = out.splitlines()[-1]
    assert done.startswith("hpar: done: "), out
    files = {
        name: open(os.path.join(run_dir, name), "rb").read()
        for name in ("summary.json", "metrics.jsonl", os.path.join("model", ".metadata"))
    }

    code, out = hpar_to_file(tmp_path / "again.txt", "run", "--resume", run_dir, "--plain")
    assert code == 0, out
    # the run's own figures (its summary's), not a resumed attempt's 0 samples/s and checkpoint loss
    assert out.splitlines() == [done.replace("hpar: done: ", "hpar: nothing to do: the run finished at step 6: ")], out
    assert all(open(os.path.join(run_dir, name), "rb").read() == data for name, data in files.items()), (
        "nothing started, nothing rewritten"
    )

    code, out = hpar_to_file(tmp_path / "more.txt", "run", "--resume", run_dir, "--plain", "--steps", "8")
    assert code == 0 and "step 8/8" in out and out.splitlines()[-1].startswith("hpar: done: "), out
    assert json.load(open(os.path.join(run_dir, "summary.json")))["steps"] == 8


@pytest.mark.timeout(240)
def test_hybrid_evaluates_and_checkpoints_on_the_same_step(tmp_path, reap_run):
    """Found by the phase deadline: worker 0 evaluated (pulling whole tables) while the server
    waited in the checkpoint's commit barrier for the workers; now the checkpoint comes first."""
    script = write_script(
        tmp_path, embed_script(steps=6) + "\ndef evaluate(model):\n    return {'w': float(model.emb.weight.sum())}\n"
    )
    run_dir = str(tmp_path / "run")
    reap_run(run_dir)
    code, out = hpar_to_file(
        tmp_path / "out.txt",
        "run",
        script,
        "--gpus",
        "2",
        "--strategy",
        "hybrid",
        "--run-dir",
        run_dir,
        "--plain",
        "--eval-every",
        "3",
        "--checkpoint-every",
        "3",
        "--stall-timeout",
        "20",
    )
    assert code == 0, out
    assert "hpar: evaluate at step 3: w " in out and os.path.exists(os.path.join(run_dir, "checkpoints", "step-3"))
