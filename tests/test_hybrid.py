"""Multi-process tests of the hybrid / ps runtimes: N workers and S parameter servers,
started with the real entry points (python -m hpar.workers.worker / .server) on gloo, must
match single-process training on the concatenated batches."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hpar.strategies.plan.cluster import free_port
from hpar.strategies.job.config import RunConfig
from hpar.strategies.job.contract import load_job
from hpar.strategies.specs.decision import Plan

from conftest import single_process_reference, final_state

JOB = textwrap.dedent('''
    """Tiny two-table model for the hybrid tests (synthetic data)."""
    import torch
    import torch.nn as nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.user = nn.Embedding(50, 4, padding_idx=0)
            self.items = nn.EmbeddingBag(40, 3, mode="mean")
            self.hashed = nn.Embedding(30, 2)   # two tables looked up with one derived tensor
            self.hbias = nn.Embedding(30, 1)
            self.mlp = nn.Sequential(nn.Linear(7, 8), nn.Tanh(), nn.Linear(8, 1))

        def forward(self, x):
            u, bag = x
            h = (u * 7) % 30
            out = self.mlp(torch.cat([self.user(u), self.items(bag)], 1)).squeeze(1)
            return out + self.hashed(h).sum(1) + self.hbias(h).squeeze(1)

    def model():
        return M()

    def data(rank, world_size, batch_size):
        g = torch.Generator().manual_seed(100 + rank)
        while True:
            u = torch.randint(0, 50, (batch_size,), generator=g)
            bag = torch.randint(0, 40, (batch_size, 3), generator=g)
            yield (u, bag), torch.randn(batch_size, generator=g)

    def loss(out, y):
        return ((out - y) ** 2).mean()

    def optimizer(params):
        return OPTIMIZER
''')

OPTS = {"momentum": "torch.optim.SGD(params, lr=0.1, momentum=0.9)", "adagrad": "torch.optim.Adagrad(params, lr=0.1)"}


def write_job(tmp_path, opt: str) -> str:
    path = tmp_path / f"job_{opt}.py"
    path.write_text(JOB.replace("OPTIMIZER", OPTS[opt]))
    return str(path)


def launch(cfg: RunConfig, timeout: float = 150, hosts: tuple = None) -> dict:
    """Start cfg.world_size workers and cfg.servers servers on this machine; returns the
    summary of worker rank 0. ``hosts`` gives each process's GROUP_RANK (workers, then
    servers) to mimic several hosts. Kills every process it started on failure."""
    os.makedirs(cfg.run_dir, exist_ok=True)
    conf = os.path.join(cfg.run_dir, "config.json")
    with open(conf, "w") as f:
        f.write(cfg.to_json())
    n, s = cfg.world_size, cfg.servers
    base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "HPAR_CONFIG": conf,
        "WORLD_SIZE": str(n),
        "HPAR_PG_WORLD_SIZE": str(n + s),
        "HPAR_NUM_SERVERS": str(s),
        "LOCAL_WORLD_SIZE": str(n),
        "OMP_NUM_THREADS": "1",
        "HPAR_PG_TIMEOUT": "120",
    }
    hosts = hosts or (0,) * (n + s)
    procs, logs = [], []

    def start(module, env, name):
        log = open(os.path.join(cfg.run_dir, f"{name}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", module], env=env, stdout=log, stderr=subprocess.STDOUT))

    try:
        for r in range(n):
            start(
                "hpar.workers.worker",
                {**base, "RANK": str(r), "LOCAL_RANK": str(r), "HPAR_PG_RANK": str(r), "GROUP_RANK": str(hosts[r])},
                f"worker{r}",
            )
        for i in range(s):
            start(
                "hpar.workers.server",
                {**base, "HPAR_SERVER_INDEX": str(i), "HPAR_PG_RANK": str(n + i), "GROUP_RANK": str(hosts[n + i])},
                f"server{i}",
            )
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        outs = []
        for log in logs:
            log.seek(0)
            outs.append(log.read())
            log.close()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} exit {p.returncode}:\n" + "\n".join(o[-2500:] for o in outs)
    summary = [line for line in outs[0].splitlines() if line.startswith("@hpar summary ")]
    assert summary, outs[0][-3000:]
    return {"summary": json.loads(summary[0][len("@hpar summary ") :]), "outputs": outs}


def assert_same(got: dict, want: dict, rtol=1e-5):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def config(tmp_path, script, strategy="hybrid", world=2, servers=1, steps=20, **kw) -> RunConfig:
    return RunConfig(
        script=script,
        strategy=strategy,
        world_size=world,
        steps=steps,
        batch_size=4,
        lr=0.1,
        seed=0,
        run_dir=str(tmp_path / kw.pop("name", "run")),
        servers=servers,
        log_every=5,
        eval=False,
        **kw,
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "opt,world,servers,partitions",
    [
        ("momentum", 2, 1, {}),
        ("momentum", 3, 2, {"user.weight": 3}),
        ("adagrad", 2, 2, {"user.weight": 1, "items.weight": 1}),  # each table whole, on its own server
        ("adagrad", 3, 1, {}),
    ],
)
def test_hybrid_matches_single_process(tmp_path, opt, world, servers, partitions):
    script = write_job(tmp_path, opt)
    cfg = config(tmp_path, script, world=world, servers=servers, plan={"partitions": partitions} if partitions else {})
    # 3 workers and 2 servers as two hosts: workers 0,1 and server 0 on host 0, worker 2 and
    # server 1 on host 1, so host 0's workers aggregate their sparse gradients locally
    hosts = (0, 0, 1, 0, 1) if (world, servers) == (3, 2) else None
    out = launch(cfg, hosts=hosts)
    want = single_process_reference(script, world, cfg.steps, cfg.batch_size, cfg.lr)
    got = final_state(cfg.run_dir)
    assert not torch.allclose(got["user.weight"], load_init(script)["user.weight"])
    assert_same(got, want)
    summary = out["summary"]
    by = summary["by_param"]
    assert {"user.weight", "items.weight", "_dense_allreduce"} <= set(by)
    # a step pulls at most batch_size distinct user rows: 4 rows x 4 floats + ids
    assert 0 < by["user.weight"]["recv"] <= 4 * 4 * 4
    assert summary["bytes_per_step"]["sent"] > 0
    assert ("_local_aggregation" in by) == (hosts is not None)
    # user and items are looked up with batch tensors: from step 1 on, their rows were
    # requested during the step before (not with local aggregation, which pushes after backward)
    assert summary["pulls_ahead"] == (0 if hosts else 2 * (cfg.steps - 1))


def load_init(script):
    torch.manual_seed(0)
    return load_job(script).build_model().state_dict()


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_ps_strategy_matches_single_process(tmp_path):
    script = write_job(tmp_path, "momentum")
    cfg = config(tmp_path, script, strategy="ps", world=2, servers=2, steps=12)
    out = launch(cfg)
    got = final_state(cfg.run_dir)
    assert_same(got, single_process_reference(script, 2, cfg.steps, cfg.batch_size, cfg.lr))
    assert "_dense_allreduce" not in out["summary"]["by_param"]
    assert "mlp.0.weight" in out["summary"]["by_param"]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_checkpoint_resume_matches_uninterrupted(tmp_path):
    script = write_job(tmp_path, "momentum")
    first = config(tmp_path, script, world=2, servers=2, steps=6, checkpoint_every=3, name="ck")
    launch(first)
    assert open(os.path.join(first.run_dir, "checkpoints", "latest")).read().strip() == "6"
    files = os.listdir(os.path.join(first.run_dir, "checkpoints", "step-3"))
    assert {f"__{r}_0.distcp" for r in range(4)} <= set(files) and ".metadata" in files  # 2 workers, 2 servers
    # each served table is one key whose chunks (one per partition, from both servers) cover every
    # row once: DCP keeps one copy of a key that several ranks write whole, so per-server tables
    # saved as plain tensors under one name would lose a server's rows without an error
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(os.path.join(first.run_dir, "checkpoints", "step-3")).read_metadata().state_dict_metadata
    for name in ("model.user.weight", "model.items.weight"):
        rows = sorted((c.offsets[0], c.sizes[0]) for c in saved[name].chunks)
        assert rows[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(rows, rows[1:])), (name, rows)
        assert rows[-1][0] + rows[-1][1] == saved[name].size[0] and len(rows) > 1, (name, rows)
    resumed = first.replace(steps=10, resume=True)
    launch(resumed)
    got = final_state(first.run_dir)
    assert_same(got, single_process_reference(script, 2, 10, first.batch_size, first.lr))


def test_a_checkpoint_reshards_onto_another_row_layout(tmp_path):
    """A server writes each table as a ShardedTensor of the parameter's shape, one shard per
    partition at its row offset (strategies/runtimes/hybrid/shard_state.py), so a server with another
    layout (another plan's partitions) reads its rows back: the same rows, optimizer slots and
    update counts (torch.distributed.checkpoint reshards)."""
    import torch.distributed as dist
    from hpar.strategies.runtimes.hybrid.client import ps_tables
    from hpar.strategies.runtimes.hybrid.ps_server import Server

    script = write_job(tmp_path, "adagrad")
    job = load_job(script)

    def server(partitions, seed=0):
        torch.manual_seed(seed)
        model = job.build_model()
        tables = ps_tables(
            model, job.build_optimizer(model.parameters(), 0.1), "hybrid", Plan(partitions=partitions), 1
        )
        return Server(config(tmp_path, script, servers=1), tables, model, index=0, num_workers=2)

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1
    )  # ShardedTensor needs one
    try:
        _reshard(tmp_path, server)
    finally:
        dist.destroy_process_group()


def _reshard(tmp_path, server):
    from hpar.strategies.state import state
    from hpar.strategies.runtimes.hybrid.shard_state import set_steps

    old = server({"user.weight": 2})
    for shard in old.shards.values():  # an update's state: Adagrad's sum and the step count
        shard.add_grad(None, torch.ones_like(shard.weight))
        shard.apply(2)
    path = str(tmp_path / "ck")
    state.write(path, old._entries())
    new = server({"user.weight": 5}, seed=1)
    assert {t.name: t.layout.num_partitions for t in new.tables.values()}["user.weight"] == 5
    entries = new._entries(state.saved_keys(path))
    state.read(path, entries)
    set_steps(new.tables, new.shards, entries)
    for tid, shard in old.shards.items():
        assert torch.equal(new.shards[tid].weight, shard.weight)
        assert torch.equal(new.shards[tid].state["sum"], shard.state["sum"]) and new.shards[tid].step == 1


def test_an_embedding_without_a_planned_count_is_cut_finely_and_a_whole_table_once_per_server():
    """`hpar run --strategy hybrid/ps` without --plan: an embedding table gets 64 partitions per
    server (a vocabulary's frequent head, its first rows, lands on every server, not all on one),
    a table kept whole one per server, and a planned count still wins."""
    from torch import nn
    from hpar.strategies.runtimes.hybrid.client import ps_tables

    model = nn.Sequential(nn.Embedding(1000, 2), nn.Linear(2, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tables = {t.name: t for t in ps_tables(model, opt, "ps", Plan(), 4)}
    assert tables["0.weight"].layout.num_partitions == 4 * 64
    assert tables["1.weight"].layout.num_partitions == 4 and tables["1.weight"].kind == "whole"
    head = tables["0.weight"].layout.server_of(torch.arange(16))  # the 16 most frequent words
    assert sorted(set(head.tolist())) == [0, 1, 2, 3]
    planned = {t.name: t for t in ps_tables(model, opt, "ps", Plan(partitions={"0.weight": 4}), 4)}
    assert set(planned["0.weight"].layout.server_of(torch.arange(16)).tolist()) == {0}


def _resolve(tmp_path, script: str, plan, strategy: str, servers):
    """``hpar run SCRIPT --gpus 2``'s checks and config (nothing started): (cfg, console text)."""
    import io
    from rich.console import Console
    from hpar.launcher.commands.run import resolve
    from hpar.launcher.run.flags import Flags

    out = io.StringIO()
    flags = dict.fromkeys(
        [
            "hosts",
            "steps",
            "batch_size",
            "lr",
            "seed",
            "log_every",
            "schedule",
            "micro_batches",
            "checkpoint_every",
            "resume_dir",
            "ssh_key",
            "ssh_port",
            "ssh_user",
            "python_path",
        ]
    )
    cfg, _, _ = resolve(
        Console(file=out, width=400),
        Flags.of(
            script=script,
            gpus=2,
            strategy=strategy,
            plan_file=plan and str(plan),
            run_dir=str(tmp_path / "run"),
            servers=servers,
            max_restarts=0,
            stall_timeout=0,
            no_eval=True,
            plain=True,
            ssh_local=False,
            sync=False,
            **flags,
        ),
    )
    return cfg, out.getvalue()


@pytest.mark.parametrize(
    "where, servers, runs",
    [
        ("allreduce", None, "allreduce"),
        ("ps", None, "hybrid"),
        ("allreduce", 1, "hybrid"),
        ("default", None, "hybrid"),  # no plan: every embedding table on the servers
        ("no embedding", None, "allreduce"),
        ("no embedding", 1, "hybrid"),
    ],
)
def test_hybrid_with_nothing_on_servers_runs_as_allreduce(tmp_path, where, servers, runs):
    """hybrid that would put no parameter on the servers (a plan keeping every table on
    AllReduce, or a model without embeddings) starts no idle server, unless --servers asks
    for one."""
    from conftest import write_script

    script = write_script(tmp_path) if where == "no embedding" else write_job(tmp_path, "momentum")
    plan = None
    if where in ("allreduce", "ps"):
        names = [n for n, _ in load_job(script).build_model().named_parameters()]
        plan = tmp_path / "plan.json"
        plan.write_text(
            json.dumps({"strategy": "hybrid", "placement": {n: where if "user" in n else "allreduce" for n in names}})
        )
    cfg, text = _resolve(tmp_path, script, plan, "auto" if plan else "hybrid", servers)
    assert cfg.strategy == runs and cfg.servers == (0 if runs == "allreduce" else 1)
    assert ("runs as allreduce" in text) == (runs == "allreduce")


def test_a_plan_naming_unknown_parameters_fails_before_anything_starts(tmp_path):
    script = write_job(tmp_path, "momentum")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"strategy": "hybrid", "placement": {"nope.weight": "ps"}}))
    with pytest.raises(ValueError, match="unknown parameters"):
        _resolve(tmp_path, script, plan, "auto", None)
    assert not (tmp_path / "run").exists()


def test_the_next_steps_rows_are_requested_once_this_steps_last_table_is_pushed():
    """PullAhead reads the next batch after this step's forward (not before: data() and the
    model draw random numbers in their usual order), sends the pulls of the modules fed from
    batch tensors only when every module looked up this step has pushed, and the next step's
    prefetch takes those answers instead of pulling again."""
    from types import SimpleNamespace
    from hpar.strategies.runtimes.hybrid import ahead, embedding

    class Client:
        def __init__(self):
            self.pulls = []

        def pull_async(self, table, ids, step):
            self.pulls.append((table.name, ids.tolist(), step))
            return lambda: torch.zeros(ids.numel(), table.dim)

    drawn = []

    def batches():
        for i in range(3):
            drawn.append(i)
            yield (torch.tensor([i + 2, 1, i + 2]), torch.tensor([5])), torch.zeros(1)

    fed = embedding.ServedEmbedding(None, SimpleNamespace(name="fed", rows=10, dim=2), source="/0")
    derived = embedding.ServedEmbedding(None, SimpleNamespace(name="derived", rows=10, dim=2))
    client = Client()
    pulls = ahead.PullAhead([fed, derived], client, batches())
    first = next(pulls)
    assert drawn == [0]
    fed.records = derived.records = [(torch.tensor([1]), torch.zeros(1, 2))]  # step 0's lookups
    pulls.plan(1)
    assert drawn == [0, 1] and client.pulls == []  # read, nothing sent yet
    fed.pushed = True
    pulls.send()
    assert client.pulls == []  # derived has not pushed
    derived.pushed = True
    pulls.send()
    assert client.pulls == [("fed", [1, 3], 1)] and pulls.sent == 1
    fed.clear()
    derived.clear()
    assert fed.ahead is not None  # clear() keeps the next step's answer
    second = next(pulls)
    assert second is not first and drawn == [0, 1]  # the batch read ahead, not a new one
    clock = embedding.StepClock()
    clock.set_batch(second[0], second[0])
    ahead.prefetch([fed, derived], client, clock)
    assert len(client.pulls) == 1 and fed.prefetched[0] is second[0][0] and fed.ahead is None
    pulls.plan(2)
    pulls.send(force=True)  # after backward, whatever was pushed
    assert client.pulls[-1] == ("fed", [1, 4], 2)
    next(pulls)
    pulls.plan(3)  # no batch left: nothing planned
    pulls.send(force=True)
    assert pulls.sent == 2 and drawn == [0, 1, 2]
