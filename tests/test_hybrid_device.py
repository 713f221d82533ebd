"""Hybrid on a GPU (issue 13, item 8), proven on CPU: a worker builds its model on the meta
device and takes the dense initial state from server 0, so a served table is never allocated
on it (tests/test_hybrid_memory.py checks the same through `hpar run` with a 2 GiB table); row
gradients go to the host by a non-blocking copy into pinned memory; ids of the batch are read
from the host copy of the batch."""

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hpar.strategies.job.config import RunConfig
from hpar.strategies.job.context import WorkerContext
from hpar.strategies.job.contract import load_job

from conftest import write_script

JOB = """
import torch, torch.nn as nn
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(5000, 16)
        self.head = nn.Linear(16, 1)
    def forward(self, ids):
        return self.head(self.table(ids)).squeeze(1)
def model():
    return M()
def data(rank, world_size, batch_size):
    while True:
        yield torch.randint(0, 5000, (batch_size,)), torch.randn(batch_size)
def loss(o, t):
    return ((o - t) ** 2).mean()
"""


class _Allocations(TorchDispatchMode):
    """Records the bytes of every tensor an aten op returns, with its device."""

    def __init__(self):
        super().__init__()
        self.seen, self.non_blocking = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "copy_" in str(func):
            self.non_blocking.append(bool(args[2] if len(args) > 2 else (kwargs or {}).get("non_blocking", False)))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.seen.append((t.device.type, t.numel() * t.element_size(), str(func)))
        return out


def test_a_worker_builds_no_served_table_and_takes_the_dense_state_from_server_0(tmp_path, monkeypatch):
    from hpar.strategies.runtimes.hybrid import build, hybrid_runtime as runtime

    monkeypatch.setattr(dist, "new_group", lambda ranks=None, backend=None, **kw: object())
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    script = write_script(tmp_path, JOB)
    torch.manual_seed(3)
    reference = load_job(script).build_model()  # what server 0 builds on the CPU with the seed
    broadcasts = []

    def from_server_0(model, ps_names, src):  # stands for the gloo broadcast of hybrid/build.py
        broadcasts.append(src)
        for mine, theirs in zip(build.dense_state(model, ps_names), build.dense_state(reference, ps_names)):
            mine.copy_(theirs)

    monkeypatch.setattr(build, "broadcast_dense", from_server_0)
    cfg = RunConfig(
        script=script,
        strategy="hybrid",
        world_size=1,
        steps=1,
        batch_size=4,
        lr=0.1,
        seed=3,
        run_dir=str(tmp_path),
        servers=1,
    )
    ctx = WorkerContext(
        job=load_job(script),
        cfg=cfg,
        rank=0,
        world_size=1,
        local_rank=0,
        device=torch.device("cpu"),
        report=lambda m: None,
    )
    with _Allocations() as allocs:
        _, model, tables, *_ = runtime._setup(ctx)  # (the model as model() returned it, the module inside, ...)
    assert [t.name for t in tables] == ["table.weight"] and broadcasts == [1]  # server 0 is default-group rank 1
    table_bytes = 5000 * 16 * 4
    real = [(n, f) for d, n, f in allocs.seen if d != "meta"]
    assert real and max(n for n, _ in real) < table_bytes, (
        f"a worker allocated {max(real)} for a {table_bytes}-byte table"
    )
    assert any(d == "meta" and n == table_bytes for d, n, _ in allocs.seen)  # the table exists as a shape only
    assert model.table.weight.numel() == 0
    assert torch.equal(model.head.weight, reference.head.weight) and torch.equal(model.head.bias, reference.head.bias)


def test_a_model_that_cannot_be_built_on_meta_is_built_on_the_cpu(tmp_path):
    from hpar.strategies.runtimes.hybrid.build import build_model

    script = write_script(
        tmp_path,
        JOB
        + """
class Scaled(M):
    def __init__(self):
        super().__init__()
        self.scale = float(self.head.weight.detach().abs().max())   # reads a value: impossible on meta
def model():
    return Scaled()
""",
    )
    model, on_meta = build_model(load_job(script), seed=0)
    assert not on_meta and model.table.weight.device.type == "cpu"
    model, on_meta = build_model(load_job(write_script(tmp_path, JOB, "plain.py")), seed=0)
    assert on_meta and model.table.weight.is_meta


class FakeEvent:
    """torch.cuda.Event on a CPU-only torch: recorded, queried, waited for."""

    made = []

    def __init__(self, *a, **kw):
        self.recorded, self.done, self.waited = False, False, False
        FakeEvent.made.append(self)

    def record(self, stream=None):
        self.recorded = True

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = self.done = True


def test_row_gradients_reach_the_host_by_a_non_blocking_copy_into_pinned_memory(monkeypatch):
    from hpar.strategies.common import devices
    from hpar.strategies.runtimes.hybrid.embedding import HostGradients

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    pinned = []
    monkeypatch.setattr(
        devices,
        "host_buffer",
        lambda shape, dtype, device: pinned.append(device.type) or torch.empty(shape, dtype=dtype),
    )
    grads = torch.randn(3, 4)
    with _Allocations() as ops:
        host, event = devices.async_copy_to_host(grads)  # what copy_to_host does with a CUDA tensor
    assert pinned == ["cuda"] and ops.non_blocking == [True], ops.seen
    assert event.recorded and not event.waited and torch.equal(host, grads)  # the host did not wait
    assert devices.copy_to_host(grads) == (grads, None)  # on the CPU: nothing to copy, nothing to wait for
    # a push waits for the copy's event, then sums rows of repeated ids
    rows = HostGradients(torch.tensor([4, 1, 4]), torch.ones(3, 2), event, merge=True)
    assert not rows.ready()
    ids, summed = rows.result()
    assert event.waited and ids.tolist() == [1, 4] and summed.tolist() == [[1, 1], [2, 2]]


def test_lookups_read_ids_from_the_host_copy_of_the_batch():
    from hpar.strategies.runtimes.hybrid.embedding import StepClock

    host = (torch.tensor([3, 1, 3]), {"bag": torch.tensor([[0, 2]])})
    device = (host[0].clone(), {"bag": host[1]["bag"].clone()})  # stands for the batch moved to a GPU
    clock = StepClock()
    clock.set_batch(host, device)
    assert clock.on_host(device[0]) is host[0] and clock.on_host(device[1]["bag"]) is host[1]["bag"]
    derived = device[0] * 2
    assert clock.on_host(derived) is derived  # computed on the device: read where it is
