"""Process groups on CUDA (issue 13, items 1-3), proven on CPU: servers only ever join gloo
groups, the workers' dense group is NCCL on CUDA, nothing but device tensors reaches it."""

import json
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from hpar.strategies.job.config import RunConfig
from hpar.strategies.plan.cluster import free_port
from hpar.strategies.specs.decision import Plan

from conftest import embed_script, write_script

pytestmark = [pytest.mark.multiprocess]


def record_groups(monkeypatch, pg_rank: int) -> list:
    """Patch the group constructors to record (ranks, backend) as this default-group rank."""
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend=None, **kw: calls.append(("default", backend)))
    monkeypatch.setattr(
        dist, "new_group", lambda ranks=None, backend=None, **kw: calls.append((tuple(ranks), backend)) or object()
    )
    monkeypatch.setattr("hpar.workers.worker.all_gather_ints", lambda values, group=None: [list(values)])
    monkeypatch.setattr(dist, "get_rank", lambda: pg_rank)
    return calls


@pytest.mark.parametrize("strategy", ["hybrid", "ps"])
def test_servers_only_join_gloo_and_workers_dense_group_is_nccl(monkeypatch, tmp_path, strategy):
    from hpar.strategies.runtimes.hybrid.hybrid_runtime import make_groups
    from hpar.workers.worker import init_group

    n, s = 4, 2
    hosts = (0, 0, 1, 1, 0, 1)  # two hosts, local aggregation on: more groups to check
    cfg = RunConfig(
        script="x.py",
        strategy=strategy,
        world_size=n,
        steps=1,
        batch_size=1,
        lr=0.1,
        seed=0,
        run_dir=str(tmp_path),
        device="cuda",
        servers=s,
    )
    seen = []
    for pg_rank in range(n + s):
        calls = record_groups(monkeypatch, pg_rank)
        init_group(cfg, pg_rank, n + s)
        make_groups(n, cfg.device, hosts, Plan())
        seen.append(calls)
        assert calls[0] == ("default", "gloo"), calls[0]  # every process: a gloo default group
        nccl = [ranks for ranks, backend in calls[1:] if backend == "nccl"]
        assert nccl == [tuple(range(n))]  # one NCCL group: exactly the workers
        if pg_rank >= n:  # a server is a member of gloo groups only (it names the NCCL one as a non-member)
            assert all(backend == "gloo" for ranks, backend in calls if ranks == "default" or pg_rank in ranks)
    assert all(c == seen[0] for c in seen), "every process must create the same groups in the same order"


def _nonmember(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from hpar.strategies.common.groups import join_default_group, worker_groups

    join_default_group(rank, 2, 60)
    if rank == 0:  # the GPU worker: this torch has no NCCL, so its NCCL group is made of gloo here
        real = dist.new_group
        dist.new_group = lambda ranks, backend=None, **kw: real(ranks, backend="gloo", **kw)
    groups = worker_groups(1, "cuda")  # rank 1 is a server: the real new_group, NCCL named, not built
    dist.barrier()
    with open(os.path.join(out, f"{rank}"), "w") as f:
        f.write(f"{groups.dense is None} {groups.backend}")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_process_without_nccl_joins_as_a_server(tmp_path):
    assert not dist.is_nccl_available() or pytest.skip("this torch has NCCL: the point is a process without it")
    mp.spawn(_nonmember, args=(free_port(), str(tmp_path)), nprocs=2)
    assert open(tmp_path / "1").read() == "True nccl"  # the server joined, outside the NCCL group
    assert open(tmp_path / "0").read() == "False nccl"


def test_loss_reduction_is_a_cpu_tensor_on_the_gloo_control_group(monkeypatch):
    from hpar.strategies.common.groups import WorkerGroups, mean_over_workers

    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: seen.append((t.device.type, group)) or t.mul_(2))
    groups = WorkerGroups(dense="nccl-group", control="gloo-group", backend="nccl")
    assert mean_over_workers([1.0, 3.0], groups, 2) == [1.0, 3.0]
    assert seen == [("cpu", "gloo-group")]


@pytest.mark.timeout(600)
def test_only_device_tensors_reach_nccl_groups(tmp_path):
    """allreduce, allreduce-sparse (the NCCL path: padded AllGather) and a 2-stage pipeline
    run in two workers with their NCCL groups emulated by gloo (one spawn for the three):
    no loss, object or barrier reaches those groups, and training gives finite losses."""
    from support.nccl_emulation import child

    runs = []
    for strategy, script, kw in [
        ("allreduce", embed_script(steps=4), {}),
        ("allreduce-sparse", embed_script(steps=4), {}),
        ("pipeline", PIPE, {"schedule": "1f1b", "micro_batches": 2}),
    ]:
        sub = tmp_path / strategy
        sub.mkdir()
        cfg = RunConfig(
            script=write_script(sub, script),
            strategy=strategy,
            world_size=2,
            steps=4,
            batch_size=4,
            lr=0.1,
            seed=0,
            run_dir=str(sub / "run"),
            device="cuda",
            log_every=2,
            eval=False,
            **kw,
        )
        os.makedirs(cfg.run_dir)
        (sub / "config.json").write_text(cfg.to_json())
        runs.append((str(sub / "config.json"), free_port()))
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(child, args=(2, runs, str(out)), nprocs=2)
    for rank in range(2):
        results = json.loads((out / f"{rank}.json").read_text())
        assert sorted(results) == ["allreduce", "allreduce-sparse", "pipeline"]
        for strategy, r in results.items():
            assert r["violations"] == [], f"{strategy}: {r['violations']}"
            assert r["loss_last"] == r["loss_last"] or (strategy == "pipeline" and rank == 1)  # finite, not NaN


PIPE = """
import torch, torch.nn as nn
def model():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randn(batch_size, 4, generator=g), torch.randn(batch_size, 1, generator=g)
def loss(o, t):
    return ((o - t) ** 2).mean()
"""
