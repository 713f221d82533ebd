"""Hybrid on a GPU (issue 13, item 8), proven on CPU: a served embedding table is handed to the
parameter servers before the model moves to the worker's device, so it is never materialised
there; ids of the batch are read from the host copy of the batch."""
import pytest
import torch
import torch.distributed as dist

from hpar.strategies.config import RunConfig
from hpar.strategies.context import WorkerContext
from hpar.strategies.job import load_job

from conftest import write_script

JOB = '''
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
'''


def test_served_table_is_empty_when_the_model_moves_to_the_device(tmp_path, monkeypatch):
    from hpar.strategies.hybrid import runtime
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, backend=None, **kw: object())
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    moves = []
    real_to = torch.nn.Module.to

    def to(self, *args, **kwargs):
        if any(isinstance(m, torch.nn.Embedding) for m in self.modules()):
            moves.append(sum(m.weight.numel() for m in self.modules() if isinstance(m, torch.nn.Embedding)))
        return real_to(self, *args, **kwargs)
    monkeypatch.setattr(torch.nn.Module, "to", to)
    script = write_script(tmp_path, JOB)
    cfg = RunConfig(script=script, strategy="hybrid", world_size=1, steps=1, batch_size=4, lr=0.1, seed=0,
                    run_dir=str(tmp_path), servers=1)
    ctx = WorkerContext(job=load_job(script), cfg=cfg, rank=0, world_size=1, local_rank=0,
                        device=torch.device("cpu"), report=lambda m: None)
    model, tables, *_ = runtime._setup(ctx)
    assert [t.name for t in tables] == ["table.weight"]
    assert moves and all(n == 0 for n in moves), f"the table went to the device with {max(moves)} values"
    assert model.table.weight.numel() == 0


def test_lookups_read_ids_from_the_host_copy_of_the_batch():
    from hpar.strategies.hybrid.embedding import StepClock
    host = (torch.tensor([3, 1, 3]), {"bag": torch.tensor([[0, 2]])})
    device = (host[0].clone(), {"bag": host[1]["bag"].clone()})     # stands for the batch moved to a GPU
    clock = StepClock()
    clock.set_batch(host, device)
    assert clock.on_host(device[0]) is host[0] and clock.on_host(device[1]["bag"]) is host[1]["bag"]
    derived = device[0] * 2
    assert clock.on_host(derived) is derived      # computed on the device: read where it is
