"""The zoo (tests/zoo/): everyday model shapes run through the real `hpar run` command, as a
batch job would (stdout to a file, not a terminal), with every strategy hpar's planner offers
for them: exit 0, a lower loss, no process left, hybrid equal to allreduce.

Which strategies apply is asked of the planner in this process (the functions `hpar profile`
runs: profile_job and choose_plan), not through `hpar profile` itself, to save a process
start per model; tests/test_profile_cli.py covers the command. allreduce-sparse differs from
allreduce only on embedding tables, so it runs on the models that have one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib

import pytest
import torch

from conftest import REPO, hpar_to_file, kill_left, final_state

pytestmark = pytest.mark.multiprocess

ZOO = os.path.join(REPO, "tests", "zoo")
TABLES = {"tied_lm", "dict_bag"}  # models with a row-sparse embedding table
# 4 stages through the real command, once per runtime family: hpar's synchronous 1F1B, its
# asynchronous schedules with a weight stash and with weight prediction, and
# torch.distributed.pipelining's 1F1B (about 37 s each in CI). gpipe and torch-gpipe run through
# `hpar run` in test_everyday_cli and test_training_loop; plain async differs from async-stash
# only inside the stage (no stash), and all of hpar's schedules on 4 processes equal the
# simulator bit for bit in test_pipeline.
SCHEDULES = ("1f1b", "async-stash", "async-predict", "torch-1f1b")
_RUNS: dict = {}
_OFFERED: dict = {}


def offered(name: str) -> set[str]:
    """The strategies the planner marks as runnable for zoo model ``name`` on 2 workers."""
    if name not in _OFFERED:
        from hpar.launcher.commands.profile import build_cluster
        from hpar.strategies.job.contract import load_job
        from hpar.strategies.plan.planner import choose_plan
        from hpar.strategies.profile.profiler import profile_job

        job = load_job(os.path.join(ZOO, f"{name}.py"))
        cluster = build_cluster(2, None, None, "10Gbps", "50us", None)
        plan = choose_plan(profile_job(job, job.defaults["batch_size"], 2, repeats=1, warmup=1), cluster)
        _OFFERED[name] = {c.strategy for c in plan.candidates if c.available}
    return _OFFERED[name]


@contextlib.contextmanager
def _locked(path):
    """An exclusive lock on file ``path`` (fcntl) while the block runs."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _runs_dir(tmp_path_factory) -> pathlib.Path:
    """Where the zoo's runs go: one directory for the whole session, shared by pytest-xdist's
    test processes (their base temp dirs sit in the session's), so that a run two tests need is
    made once even when the two land on different test processes."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "zoo-runs"
    shared.mkdir(exist_ok=True)
    return shared


def hpar_run(tmp_path_factory, name: str, strategy: str, gpus: int = 2, *flags: str, evaluate: bool = False) -> dict:
    """Run `hpar run tests/zoo/NAME.py` once per (name, strategy, flags) in this session (over
    all test processes), stdout and stderr to files; returns exit code, summary, output and run
    dir. Fails if any process of the run is left once the command returned. ``--no-eval``
    unless ``evaluate``."""
    key = (name, strategy, gpus, flags, evaluate)
    if key not in _RUNS:
        slug = f"{name}-{strategy}-{gpus}-" + hashlib.sha1(repr((flags, evaluate)).encode()).hexdigest()[:8]
        runs = _runs_dir(tmp_path_factory)
        base = runs / slug
        run_dir, out, result = base / "run", base / "stdout.txt", base / "result.json"
        with _locked(runs / f"{slug}.lock"):
            if not result.exists():
                base.mkdir(exist_ok=True)  # a run that raised (its timeout) left it without a result
                rc, _ = hpar_to_file(
                    out,
                    "run",
                    os.path.join(ZOO, f"{name}.py"),
                    "--gpus",
                    str(gpus),
                    "--strategy",
                    strategy,
                    "--run-dir",
                    str(run_dir),
                    *(() if evaluate else ("--no-eval",)),
                    *flags,
                    cwd=str(base),
                )
                result.write_text(json.dumps({"rc": rc, "left": [p.pid for p in kill_left(run_dir)]}))
        summary_path = run_dir / "summary.json"
        _RUNS[key] = {
            **json.loads(result.read_text()),
            "out": out.read_text(),
            "summary": json.loads(summary_path.read_text()) if summary_path.exists() else {},
            "run_dir": run_dir,
        }
    return _RUNS[key]


def check_trained(r: dict) -> None:
    assert r["rc"] == 0, r["out"][-3000:]
    assert not r["left"], f"processes left behind: {r['left']}"
    s = r["summary"]
    # the means over the first and last steps, as `hpar run` prints them: one step's loss on a
    # batch of 8 with dropout is noise (nested_cnn's pipeline once read 1.05 -> 1.41 while its
    # means went 0.98 -> 0.71)
    assert s["exit_code"] == 0 and s["loss_last_mean"] < s["loss_first_mean"], s


DDP_WARNING = "find_unused_parameters=True was specified in DDP constructor"


def ddp_warned(r: dict) -> bool:
    """Whether torch's warning of a needless find_unused_parameters=True is in the run's
    output or in one of its rank logs."""
    logs = sorted((r["run_dir"] / "logs").glob("*.log")) if (r["run_dir"] / "logs").exists() else []
    return DDP_WARNING in r["out"] or any(DDP_WARNING in log.read_text(errors="replace") for log in logs)


# Every strategy the planner offers, once per model shape it matters for (each run starts 3-4
# processes, so the set is kept small): allreduce-sparse and hybrid where there is an embedding
# table; ps (every parameter on the servers) on the table models and on the frozen parameter.
DATA_PARALLEL = [
    ("tied_lm", "allreduce"),
    ("tied_lm", "allreduce-sparse"),
    ("tied_lm", "hybrid"),
    ("tied_lm", "ps"),
    ("dict_bag", "allreduce"),
    ("dict_bag", "allreduce-sparse"),
    ("dict_bag", "hybrid"),
    ("dict_bag", "ps"),
    ("frozen", "allreduce"),
    ("frozen", "ps"),
    ("sometimes_unused", "allreduce"),
    ("tuple_out", "allreduce"),
    ("tied_lm", "fsdp"),
    ("dict_bag", "fsdp"),
]
PIPELINED = ("nested_cnn", "frozen", "pipe4")


@pytest.mark.parametrize("name,strategy", DATA_PARALLEL, ids=[f"{n}-{s}" for n, s in DATA_PARALLEL])
def test_zoo_data_parallel(tmp_path_factory, name, strategy):
    if strategy != "hybrid":  # hybrid is offered by name only where it would use its servers; it runs everywhere
        assert strategy in offered(name), f"the planner does not offer {strategy} for {name}: {offered(name)}"
    r = hpar_run(tmp_path_factory, name, strategy)
    check_trained(r)
    # DDP looks for unused parameters only where a profiled step left one without a gradient
    # (strategies/runtimes/dataparallel/ddp.py); torch then warns on the first step, which used the branch
    assert ddp_warned(r) == (name == "sometimes_unused"), r["out"][-2000:]
    assert ("DDP looks for unused parameters every step" in r["out"]) == (name == "sometimes_unused"), r["out"][-2000:]


def test_zoo_find_unused_parameters_forced(tmp_path_factory):
    """--find-unused-parameters on reaches DDP (torch's warning shows it, on a model without an
    unused parameter); off, on the model whose branch is skipped every other step, ends the run
    with one line naming the flag (exit 2: the flag given refuses what the run needs, which the
    launcher would otherwise restart with the setting on), no traceback, nothing left."""
    on = hpar_run(tmp_path_factory, "tuple_out", "allreduce", 2, "--find-unused-parameters", "on")
    check_trained(on)
    assert ddp_warned(on), on["out"][-2000:]
    off = hpar_run(tmp_path_factory, "sometimes_unused", "allreduce", 2, "--find-unused-parameters", "off")
    assert off["rc"] == 2 and not off["left"], off["out"][-3000:]
    hint = [l for l in off["out"].splitlines() if "find_unused_parameters is off" in l]
    assert hint and hint[-1].strip().endswith("run with --find-unused-parameters on"), off["out"][-3000:]
    assert "(extra.weight, extra.bias on worker" in hint[-1] and "Traceback" not in off["out"], off["out"][-3000:]
    last = off["out"].rstrip().splitlines()
    assert last[-2] == hint[-1], off["out"][-3000:]  # the peers' gloo complaints stay in their logs
    assert last[-1].startswith("hpar: failed (exit code 2)") and "no checkpoint to resume from" in last[-1], last[-1]


def test_zoo_allreduce_sparse_without_a_table_runs_as_allreduce(tmp_path_factory):
    """allreduce-sparse on a model with no embedding table is DDP with dense gradients: `hpar
    run` says so and runs allreduce (`hpar bench` then reports the row as "ran as allreduce"
    and leaves it out of the strategy ranking, as a hybrid plan with nothing on its servers)."""
    r = hpar_run(tmp_path_factory, "frozen", "allreduce-sparse")
    check_trained(r)
    assert "allreduce-sparse has no embedding table" in r["out"] and r["summary"]["strategy"] == "allreduce", r["out"]
    assert "allreduce-sparse" not in offered("frozen")


def test_zoo_every_offered_strategy_is_covered():
    """What the planner offers for each model is run here, except: ps where the model has no
    embedding table (ps runs on one dense model, frozen), data parallelism on the
    pipeline-only shapes, and fsdp but on the tied and the dict-batch models (test_fsdp.py
    compares it with one process), and TorchRec's shardings (tests/test_torchrec.py runs them).
    allreduce-sparse is offered only where there is a table."""
    for name in ("tied_lm", "dict_bag", "frozen", "sometimes_unused", "tuple_out", "nested_cnn", "pipe4"):
        ran = {s for n, s in DATA_PARALLEL if n == name} | ({"pipeline"} if name in PIPELINED else set())
        want = set(offered(name))
        if name not in TABLES:
            assert "allreduce-sparse" not in want, (name, want)  # it would run as allreduce
            want -= {"ps"} if name != "frozen" else set()
        if name in ("nested_cnn", "pipe4"):
            want -= {"allreduce"}
        if name not in ("tied_lm", "dict_bag"):
            want -= {"fsdp"}
        want = {s for s in want if not s.startswith("torchrec")}  # TorchRec's rows: tests/test_torchrec*.py
        assert want <= ran, (name, want - ran)
        assert name not in PIPELINED or "pipeline" in offered(name)


@pytest.mark.parametrize("name", ["tied_lm", "dict_bag"])
def test_zoo_hybrid_equals_allreduce(tmp_path_factory, name):
    """Hybrid (tables on the servers, the tied weight on AllReduce) trains the same model as
    allreduce: both are synchronous SGD on the same batches."""
    ar, hy = hpar_run(tmp_path_factory, name, "allreduce"), hpar_run(tmp_path_factory, name, "hybrid")
    check_trained(ar)
    check_trained(hy)
    if name == "tied_lm":
        assert "runs as allreduce" not in hy["out"], hy["out"][-2000:]  # the doc table is served
    a = final_state(ar["run_dir"])
    h = final_state(hy["run_dir"])
    assert a.keys() == h.keys()
    for k in a:
        torch.testing.assert_close(h[k], a[k], rtol=1e-4, atol=1e-5, msg=k)


def test_zoo_tables_kept_whole_spread_over_the_servers(tmp_path_factory):
    """A plan that keeps every table whole (one partition each, what the planner picks for small
    tables where requests cost CPU) on 2 servers: `hpar run --strategy ps` puts tables 0 and 2
    on server 0 and tables 1 and 3 on server 1 (each table starts on its own server), and
    trains the same model as allreduce."""
    base = tmp_path_factory.mktemp("whole-tables")
    plan = base / "plan.json"
    plan.write_text(
        json.dumps(
            {"strategy": "ps", "partitions": {n: 1 for n in ("emb.weight", "doc.weight", "mix.weight", "mix.bias")}}
        )
    )
    ps = hpar_run(tmp_path_factory, "tied_lm", "ps", 2, "--servers", "2", "--plan", str(plan))
    check_trained(ps)
    for server in (0, 1):
        log = (ps["run_dir"] / "logs" / f"server-{server}.log").read_text()
        assert f'"server":{server},"message":"serving 2 table shard(s) from step 0"' in log, log[-1500:]
    ar = hpar_run(tmp_path_factory, "tied_lm", "allreduce")
    check_trained(ar)
    a, p = final_state(ar["run_dir"]), final_state(ps["run_dir"])
    for k in a:
        torch.testing.assert_close(p[k], a[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("name", ["nested_cnn", "frozen"])
def test_zoo_pipeline(tmp_path_factory, name):
    assert "pipeline" in offered(name)
    r = hpar_run(tmp_path_factory, name, "pipeline")
    check_trained(r)
    assert "hpar: pipeline plan: 2 stages" in r["out"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_zoo_four_stage_pipeline(tmp_path_factory, schedule):
    """4 stages (so 2 middle stages, which report no loss) with each kind of schedule (one replica:
    the planner may otherwise pick 2 stages x 2 replicas for --gpus 4)."""
    r = hpar_run(
        tmp_path_factory,
        "pipe4",
        "pipeline",
        4,
        "--schedule",
        schedule,
        "--micro-batches",
        "4",
        "--pipeline-replicas",
        "1",
    )
    check_trained(r)
    assert "loss -" in r["out"]  # a middle stage's progress line, not a crash
    stages = r["summary"]["stages"]  # what `hpar bench` reports per schedule: bubble and peak memory
    assert len(stages) == 4 and all(isinstance(s["peak_mem_bytes"], int) and s["idle_s"] >= 0 for s in stages)
