"""Unit tests of the parameter-server shard: row layout and the sparse optimizers against
torch.optim on dense tensors (no processes)."""

import pytest
import torch

from hpar.strategies.runtimes.hybrid.shard import ParamShard, RowLayout, table_view

from hpar.strategies.job.optimizer_rules import OptimizerSpec, spec_from_group


@pytest.mark.parametrize(
    "rows,parts,servers,first",
    [(10, 1, 1, 0), (10, 3, 2, 0), (7, 7, 3, 2), (100, 5, 2, 1), (5, 2, 4, 0), (5, 2, 4, 3), (12, 1, 4, 2)],
)
def test_layout_covers_every_row_once(rows, parts, servers, first):
    lay = RowLayout.make(rows, parts, servers, first)
    held = [lay.server_rows(s) for s in range(servers)]
    allrows = torch.sort(torch.cat(held)).values
    assert torch.equal(allrows, torch.arange(rows))
    for s in range(servers):
        ids = held[s]
        assert bool((lay.server_of(ids) == s).all())
        assert torch.equal(lay.local_index(s, ids), torch.arange(ids.numel()))


def test_layout_clamps_partitions_and_round_robin():
    lay = RowLayout.make(4, 10, 2)
    assert lay.num_partitions == 4
    assert lay.server_of(torch.tensor([0, 1, 2, 3])).tolist() == [0, 1, 0, 1]


def test_layout_starts_at_its_first_server_and_fewer_partitions_use_fewer_servers():
    """ps_tables gives table t first server t % S: a table kept whole (P = 1) lives on one
    server, and partitions go round-robin from the first server on."""
    whole = RowLayout.make(12, 1, 4, first_server=6)  # 6 % 4
    assert whole.first_server == 2
    assert [whole.server_rows(s).numel() for s in range(4)] == [0, 0, 12, 0]
    assert torch.equal(whole.local_index(2, torch.tensor([11, 0, 5])), torch.tensor([11, 0, 5]))
    three = RowLayout.make(9, 3, 4, first_server=3)
    assert three.server_of(torch.tensor([0, 3, 6, 8])).tolist() == [3, 0, 1, 1]
    assert torch.equal(three.local_index(1, torch.tensor([8, 6])), torch.tensor([2, 0]))
    with pytest.raises(AssertionError, match="wrong server"):
        three.local_index(0, torch.tensor([0]))


def _run_both(make_opt, steps=6, rows=12, dim=3, parts=3, servers=2, workers=2, mode="exact", seed=0):
    """Train a (rows, dim) table with torch.optim on the dense mean gradient and with sharded
    ParamShards fed the same gradients as row pushes; returns both tables."""
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(rows, dim, generator=g)
    ref = torch.nn.Parameter(w0.clone())
    opt = make_opt([ref])
    spec = spec_from_group(opt, opt.param_groups[0], mode=mode)
    lay = RowLayout.make(rows, parts, servers)
    shards = [ParamShard(w0[lay.server_rows(s)], spec) for s in range(servers)]
    for step in range(steps):
        skip = step == 2  # a step where the parameter gets no gradient at all
        dense = torch.zeros(rows, dim)
        for _ in range(workers):
            ids = torch.unique(torch.randint(0, rows, (4,), generator=g))
            rg = torch.randn(ids.numel(), dim, generator=g)
            if skip:
                continue
            dense.index_add_(0, ids, rg)
            owner = lay.server_of(ids)
            for s in range(servers):
                sel = ids[owner == s]
                shards[s].add_grad(lay.local_index(s, sel), rg[owner == s])
        if not skip:
            ref.grad = dense / workers
            opt.step()
        for sh in shards:
            sh.apply(workers)
    got = torch.empty(rows, dim)
    for s in range(servers):
        got[lay.server_rows(s)] = shards[s].weight
    return ref.detach(), got, w0


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_wd": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "nesterov_damp": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.02),
    "dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.7, dampening=0.3),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.3),
    "adagrad_opts": lambda p: torch.optim.Adagrad(
        p, lr=0.3, lr_decay=0.1, initial_accumulator_value=0.2, weight_decay=0.01
    ),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adam_wd": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, betas=(0.8, 0.95)),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_exact_mode_matches_torch_optim(name):
    ref, got, w0 = _run_both(OPTIMIZERS[name])
    assert not torch.allclose(ref, w0)  # training moved the table
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("servers,parts,workers", [(1, 1, 3), (3, 5, 2)])
def test_exact_momentum_other_layouts(servers, parts, workers):
    ref, got, _ = _run_both(OPTIMIZERS["momentum"], servers=servers, parts=parts, workers=workers, seed=3)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_lazy_adam_leaves_untouched_rows_alone():
    w0 = torch.randn(6, 2)
    spec = OptimizerSpec("adam", lr=0.1, mode="lazy")
    sh = ParamShard(w0, spec)
    sh.add_grad(torch.tensor([1]), torch.ones(1, 2))
    sh.apply(1)
    sh.add_grad(torch.tensor([3]), torch.ones(1, 2))
    sh.apply(1)
    changed = (sh.weight != w0).any(dim=1)
    assert changed.tolist() == [False, True, False, True, False, False]
    # row 1's moments did not move in step 2 (lazy), unlike dense Adam
    assert torch.allclose(sh.state["exp_avg"][1], torch.full((2,), 0.1))


def test_lazy_equals_exact_where_untouched_update_is_zero():
    a, b, _ = _run_both(OPTIMIZERS["adagrad"], mode="lazy", seed=5)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_push_of_all_rows_and_table_view():
    spec = OptimizerSpec("sgd", lr=1.0)
    sh = ParamShard(torch.zeros(3, 2), spec)
    sh.add_grad(None, torch.ones(3, 2))
    sh.add_grad(None, 3 * torch.ones(3, 2))
    sh.apply(2)
    assert torch.equal(sh.weight, -2 * torch.ones(3, 2))
    assert table_view(torch.zeros(4, 2, 3)).shape == (4, 6)
    assert table_view(torch.zeros(5)).shape == (5, 1)
    assert table_view(torch.tensor(1.0)).shape == (1, 1)


def test_state_dict_round_trip_continues_identically():
    spec = OptimizerSpec("adam", lr=0.1)
    a = ParamShard(torch.randn(4, 2), spec)
    for _ in range(2):
        a.add_grad(torch.tensor([0, 2]), torch.randn(2, 2))
        a.apply(1)
    b = ParamShard(torch.zeros(4, 2), spec)
    b.load_state_dict(a.state_dict())
    g = torch.randn(1, 2)
    for sh in (a, b):
        sh.add_grad(torch.tensor([1]), g)
        sh.apply(1)
    assert torch.equal(a.weight, b.weight)
    with pytest.raises(ValueError, match="--servers"):
        ParamShard(torch.zeros(5, 2), spec).load_state_dict(a.state_dict())


def test_unsupported_optimizers_raise_value_error():
    p = [torch.nn.Parameter(torch.zeros(2))]
    for opt, match in [
        (torch.optim.RMSprop(p), "RMSprop"),
        (torch.optim.Adam(p, amsgrad=True), "amsgrad"),
        (torch.optim.SGD(p, lr=0.1, maximize=True), "maximize"),
    ]:
        with pytest.raises(ValueError, match=match):
            spec_from_group(opt, opt.param_groups[0])
    with pytest.raises(ValueError, match="sparse_optimizer"):
        spec_from_group(torch.optim.SGD(p, lr=0.1), {"lr": 0.1}, mode="eager")


@pytest.mark.parametrize("mode", ["exact", "lazy"])
def test_a_steps_pushes_are_summed_in_the_workers_order_whatever_their_arrival(mode):
    """Float addition is not associative: with 3 or more workers, summing pushes as they
    arrive made a run differ from its repeat in the last bits. Summed by sender, it does not."""
    g = torch.Generator().manual_seed(3)
    pushes = [(w, torch.randint(0, 50, (20,), generator=g).unique(), None) for w in range(5)]
    pushes = [(w, ids, torch.randn(ids.numel(), 4, generator=g) * 10**w) for w, ids, _ in pushes]
    got = []
    for order in ([0, 1, 2, 3, 4], [3, 0, 4, 2, 1], [4, 3, 2, 1, 0]):
        sh = ParamShard(torch.zeros(50, 4), OptimizerSpec("sgd", lr=1.0, mode=mode))
        for w in order:
            sh.add_grad(pushes[w][1], pushes[w][2], sender=w)
        sh.apply(5)
        got.append(sh.weight)
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
