"""Telling a stalled process from the peers waiting on it, without a run: the stacks' summary,
the health check's blame, and the resume step past a damaged checkpoint (issue 18)."""

import os

import torch


DUMP_WAITING = """Thread 0x00007f5a1c5ff640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f5a2a6a4740 (most recent call first):
  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/x/hpar/strategies/allreduce.py", line 120 in train
  File "<frozen runpy>", line 88 in _run_code
""".splitlines()
DUMP_ELSEWHERE = """Current thread 0x00007f5a2a6a4740 (most recent call first):
  File "/home/u/train.py", line 14 in data
  File "/x/hpar/strategies/job.py", line 124 in _user_items
  File "<frozen runpy>", line 88 in _run_code
""".splitlines()


def test_stack_summary_groups_processes_and_finds_the_one_elsewhere():
    from hpar.launcher.run import stacks

    lines, odd = stacks.summarize(
        {"worker 0": DUMP_WAITING, "worker 2": DUMP_WAITING, "worker 1": DUMP_ELSEWHERE},
        {"server 0": "stopped (SIGSTOP?)"},
    )
    assert lines == [
        "  worker 0, worker 2: in torch.distributed: all_reduce (distributed_c10d.py:2501) <- allreduce.py:120 train",
        "  worker 1: elsewhere: data (train.py:14) <- job.py:124 _user_items",
        "  server 0: no stack (stopped (SIGSTOP?))",
    ]
    assert odd == ["worker 1"]
    assert stacks.summarize({"worker 0": DUMP_ELSEWHERE}, {})[1] == [], "nobody waits: nobody is odd"


def test_health_blames_the_silent_process_not_its_waiting_peer(monkeypatch):
    from hpar.launcher.run import health

    clock = [1000.0]
    monkeypatch.setattr(health.time, "monotonic", lambda: clock[0])
    h = health.Health(["w0", "w1"], ["worker", "worker"], total_steps=100, stall_timeout=5)
    for key in ("w0", "w1"):
        h.line(key)
        h.heartbeat(key, {"at_step": 0})
        h.phase(key, "train")
    clock[0] += 3.0  # start-up is no stall, however long the first step takes
    assert h.stalled(["w0", "w1"]) == []
    for key in ("w0", "w1"):
        h.line(key)
        h.heartbeat(key, {"at_step": 7})
    clock[0] += 1.0
    h.line("w0")
    h.heartbeat("w0", {"at_step": 7})  # w0 alive, waiting; w1 went silent (SIGSTOP)
    clock[0] += 4.5
    h.line("w0")
    stalled = h.stalled(["w0", "w1"])  # w0's step stopped too (it waits for w1): the silent one comes first
    assert stalled[0] == ("w1", "stalled: silent for 5 s (--stall-timeout), the process is frozen or stopped")
    h.phase("w1", "evaluate")  # nobody steps while rank 0 evaluates
    clock[0] += 100
    h.line("w0"), h.line("w1")
    assert h.stalled(["w0", "w1"]) == []
    h.state["w1"].exited_cleanly = True  # it announced exit code 0: leaving, however slowly it goes
    clock[0] += 10  # silent for twice --stall-timeout
    assert h.stalled(["w1"]) == []
    clock[0] += health.EXIT_GRACE_S
    assert ("w1", f"stalled: still running {health.EXIT_GRACE_S:.0f} s after it announced its exit") in h.stalled(
        ["w1"]
    )


def test_usable_step_falls_back_past_a_damaged_checkpoint(tmp_path):
    from hpar.strategies.state import checkpoint
    from hpar.strategies.state import state

    run_dir = str(tmp_path)
    for step in (2, 4):
        state.save(run_dir, step, {"model.w": torch.full((100,), float(step))})
    assert checkpoint.usable_step(run_dir) == (4, [])
    part = os.path.join(checkpoint.step_dir(run_dir, 4), "__0_0.distcp")
    open(part, "r+b").truncate(50)
    step, problems = checkpoint.usable_step(run_dir)
    assert step == 2 and problems == [f"{part}: checksum mismatch (truncated or altered)"]
    open(os.path.join(run_dir, "checkpoints", "latest"), "w").write("\x00garbage")
    step, problems = checkpoint.usable_step(run_dir)
    assert step == 2 and "latest: not a step number" in problems[0]
    assert checkpoint.remove_temp_files(run_dir) == []
