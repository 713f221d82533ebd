"""strategies/common/gather.py: the tensor collectives that replace torch's pickling
``*_object`` collectives give the same results as those, over a real two-process gloo group,
and the shipped code no longer calls an ``*_object`` collective (issue 61)."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import REPO
from hpar.strategies.plan.cluster import free_port

# what each rank sends: mixed JSON documents (None, NaN, nested lists, strings) of unequal length
DOCS = [
    {
        "stage": 0,
        "layers": [0, 3],
        "compute_s": 0.125,
        "idle_s": None,
        "peak_mem_bytes": 2**40 + 3,
        "name": "stagé",
        "nan": float("nan"),
    },
    {"stage": 1, "replica": 1, "layers": [[3, 5], [7, 9]], "compute_s": 1e-9, "idle_s": 0.5, "peak_mem_bytes": None},
]


def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {
        f"layer{rank}.weight": torch.randn(3, 4, generator=g),
        f"layer{rank}.bias": torch.randn(4, generator=g),
        f"norm{rank}.steps": torch.tensor(rank + 7),
        f"emb{rank}": torch.randn(5, 2, generator=g).to(torch.bfloat16),
        f"mask{rank}": torch.tensor([True, False, rank == 1]),
        f"empty{rank}": torch.zeros(0, 3),
        f"half{rank}": torch.randn(2, 3, generator=g).half()[:, 1:],
    }  # not contiguous


def _child(rank: int, port: int, out: str) -> None:
    from hpar.strategies.common.gather import all_gather_ints, all_gather_json, gather_json, gather_state_dicts

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    mine = [rank, 2**40 + rank, -1]
    objects = [None, None]
    dist.all_gather_object(objects, mine)
    results["ints"] = (all_gather_ints(mine), [list(o) for o in objects])
    objects = [None, None]
    dist.all_gather_object(objects, DOCS[rank])
    results["all_json"] = (all_gather_json(DOCS[rank]), objects)
    group = dist.new_group([0, 1])
    gathered = [None, None] if rank == 1 else None
    dist.gather_object(DOCS[rank], gathered, group=group, group_dst=1)
    results["json"] = (gather_json(DOCS[rank], group=group, group_dst=1), gathered)
    gathered = [None, None] if rank == 0 else None
    dist.gather_object(_state(rank), gathered, dst=0)
    results["states"] = (gather_state_dicts(_state(rank), group_dst=0), gathered)
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, os.path.join(out, f"{rank}.pt"))


def _same(a, b) -> bool:
    """Equal values, NaN equal to NaN, tuples equal to lists (JSON has no tuples)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_tensor_collectives_give_what_the_object_collectives_gave(tmp_path):
    mp.spawn(_child, args=(free_port("127.0.0.1"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2))
    for results in (r0, r1):
        for key in ("ints", "all_json"):
            ours, theirs = results[key]
            assert _same(ours, theirs), (key, ours, theirs)
    assert r0["json"][0] is None and _same(r1["json"][0], DOCS) and _same(r1["json"][0], r1["json"][1])
    assert r1["states"][0] is None
    ours, theirs = r0["states"]
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        assert list(a) == list(b)
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
            assert torch.equal(a[name], b[name]), name


def test_json_documents_refuse_what_json_cannot_hold():
    from hpar.strategies.common.gather import _dtype, _encode

    with pytest.raises(TypeError):
        _encode({"x": object()})
    assert json.loads(_encode({"a": (1, 2.5, None)})) == {"a": [1, 2.5, None]}
    assert _dtype("bfloat16") is torch.bfloat16
    for name in ("load", "nn", "no_such_thing"):
        with pytest.raises(ValueError):
            _dtype(name)


def test_no_pickling_object_collective_is_left():
    """The shipped code gathers numbers and documents as tensors: no ``*_object`` collective
    (all_gather_object, gather_object, broadcast_object_list, scatter_object_list)."""
    found = []
    for top in ("launcher", "strategies", "workers"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                if f.endswith(".py"):
                    text = open(os.path.join(root, f), encoding="utf-8").read()
                    found += [
                        f"{os.path.join(root, f)}: {m}" for m in re.findall(r"dist\.\w+_object(?:_list)?\(", text)
                    ]
    assert not found, found
