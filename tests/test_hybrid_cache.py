"""The hot-row cache's version protocol in one process (strategies/runtimes/hybrid/cache.py and
versions.py, after HET, VLDB 2022): workers' caches and a parameter server's books and row
versions driven through synchronous steps, checking the staleness bound on every read and
every held-back gradient; the pieces alone; the profile's prediction; the planner's candidate."""

from types import SimpleNamespace

import pytest
import torch

from hpar.strategies.runtimes.hybrid.cache import RowCache

from hpar.strategies.specs.servers_spec import CacheConfig
from hpar.strategies.runtimes.hybrid.shard import RowLayout
from hpar.strategies.runtimes.hybrid.versions import CacheBook, mask_bytes, pack_bits, unpack_bits
from hpar.strategies.profile.hot_rows import HotRows, cache_shares


def _table(rows=60, servers=2, partitions=6, dim=3):
    return SimpleNamespace(
        tid=0,
        name="emb.weight",
        rows=rows,
        dim=dim,
        dtype=torch.float32,
        layout=RowLayout.make(rows, partitions, servers),
    )


def simulate(staleness: int, workers: int = 3, steps: int = 45, epoch: int = 10, seed: int = 0) -> dict:
    """Synchronous steps of ``workers`` caches of 16 rows against one table on 2 servers: each
    step every worker looks up skewed rows (the hot ones every step), reads what its cache
    allows, pulls the rest (the server records and answers bits, versions.CacheBook), pushes what
    RowCache.outgoing gives, and the server applies the step (every pushed row's version + 1).
    Asserts the bounds on the way; returns counts and every push."""
    table = _table()
    layout = table.layout
    versions = torch.zeros(table.rows, dtype=torch.int64)  # global view of the servers' row versions
    books = [CacheBook(staleness) for _ in range(layout.num_servers)]
    caches = [RowCache(table, torch.arange(16), 16, staleness) for _ in range(workers)]
    copy_at = [dict() for _ in range(workers)]  # row -> the version a worker's copy was sent at
    held = [dict() for _ in range(workers)]  # row -> this worker's updates of it held back
    given = [torch.zeros(table.rows) for _ in range(workers)]
    pushed_sum = [torch.zeros(table.rows) for _ in range(workers)]
    g = torch.Generator().manual_seed(seed)
    out = {"hits": 0, "reads": 0, "pushes": []}
    for step in range(steps):
        if step % epoch == 0:  # an epoch: new rows (refreshed after the first), the servers told
            for w, cache in enumerate(caches):
                cache.new_epoch(cache.next_rows(refresh=step > 0))
                copy_at[w].clear()
                for s, book in enumerate(books):
                    book.announce(w, 0, layout.local_index(s, cache.ids[cache.on_server[s]]))
        last_of_epoch = (step + 1) % epoch == 0 or step + 1 == steps
        pushes = []
        for w, cache in enumerate(caches):
            ids = torch.unique(torch.cat([torch.arange(4), (table.rows * torch.rand(8, generator=g) ** 3).long()]))
            hit, _ = cache.split(ids, step)
            for r in ids[hit].tolist():  # a read from the cache: at most s updates behind the servers'
                assert versions[r] - copy_at[w][r] <= staleness, (step, w, r)
            out["hits"] += int(hit.sum())
            out["reads"] += ids.numel()
            miss = ids[~hit]
            for s, book in enumerate(books):
                sel = miss[layout.server_of(miss) == s]
                local = layout.local_index(s, sel)
                server_versions = versions[layout.server_rows(s)]
                bits = book.answer(w, 0, local, server_versions)
                assert bits.numel() == mask_bytes(cache.on_server[s].numel())
                cache.fill(sel, versions[sel].float().unsqueeze(1).expand(-1, table.dim))
                member, _ = cache.slots(sel)
                for r in sel[member].tolist():
                    copy_at[w][r] = int(versions[r])
                if sel.numel():  # no pull to a server, no bits from it
                    cache.readable(s, bits, step)
            grads = torch.ones(ids.numel(), table.dim) * (step + 1)
            given[w][ids] += step + 1
            got = cache.outgoing((ids, grads), last_of_epoch)
            if staleness == 0:  # nothing held: hybrid's push exactly
                assert torch.equal(got[0], ids) and torch.equal(got[1], grads)
            member, _ = cache.slots(ids)
            for r in ids[member].tolist():
                held[w][r] = held[w].get(r, 0) + 1
            for r in got[0].tolist():
                held[w].pop(r, None)
            # at most s of a worker's updates of a row are held back (HET's bound on its clock)
            assert all(n <= staleness for n in held[w].values()), (step, w, held[w])
            pushed_sum[w][got[0]] += got[1][:, 0]
            pushes.append(got)
        out["pushes"].append(pushes)
        touched = torch.unique(torch.cat([p[0] for p in pushes]))
        versions[touched] += 1  # the server applies the step
        if last_of_epoch:  # nothing held back past an epoch: every gradient given was pushed
            for w in range(workers):
                assert not held[w] and torch.equal(pushed_sum[w], given[w])
    return out


@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
def test_every_read_and_every_held_gradient_stays_within_the_staleness_bound(staleness):
    got = simulate(staleness)
    if staleness == 0:
        assert got["hits"] == 0
    else:  # not vacuous: the hot rows are read from the caches, more often the staler they may be
        assert got["hits"] > 0.2 * got["reads"]
        assert got["hits"] < simulate(staleness + 2)["hits"]


def test_the_bits_clear_once_a_row_is_s_versions_ahead_of_the_copy_sent():
    book = CacheBook(staleness=2)
    versions = torch.zeros(10, dtype=torch.int64)
    book.announce(worker=1, tid=0, local=torch.tensor([2, 5, 7]))
    assert unpack_bits(book.answer(1, 0, torch.tensor([5]), versions), 3).tolist() == [False, True, False]
    versions[5] += 1  # one update: the copy may still be read next step (1 + 1 <= 2)
    assert unpack_bits(book.answer(1, 0, torch.tensor([], dtype=torch.int64), versions), 3).tolist() == [
        False,
        True,
        False,
    ]
    versions[5] += 1  # two: the next step may see a third
    assert unpack_bits(book.answer(1, 0, torch.tensor([2]), versions), 3).tolist() == [True, False, False]
    assert book.answer(0, 0, None, versions).numel() == 0  # worker 0 announced nothing here
    book.announce(1, 0, torch.tensor([2, 5, 7]))  # a new epoch: nothing sent yet
    assert not unpack_bits(book.answer(1, 0, torch.tensor([], dtype=torch.int64), versions), 3).any()


@pytest.mark.parametrize("m", [0, 1, 7, 8, 9, 100])
def test_bits_round_trip(m):
    flags = torch.rand(m, generator=torch.Generator().manual_seed(m)) < 0.5
    packed = pack_bits(flags)
    assert packed.dtype == torch.uint8 and packed.numel() == mask_bytes(m)
    assert torch.equal(unpack_bits(packed, m), flags)


def test_a_refresh_keeps_the_most_looked_up_rows_and_prefers_the_cached_on_ties():
    cache = RowCache(_table(), torch.tensor([0, 1, 2]), 3, 1)
    for ids in ([5, 9], [5, 9, 1], [5, 40]):
        cache.split(torch.tensor(ids), step=0)
    assert cache.next_rows(refresh=True).tolist() == [1, 5, 9]  # 5: 3 times, 9: twice, 1: once and cached
    assert cache.next_rows(refresh=False).tolist() == [0, 1, 2]
    cache.new_epoch(cache.next_rows(refresh=True))
    assert cache.ids.tolist() == [1, 5, 9] and cache.window == [] and (cache.ok == -1).all()


def test_a_cached_rows_gradients_leave_with_its_s_plus_first_update_or_at_an_epochs_end():
    cache = RowCache(_table(), torch.tensor([3, 4]), 2, staleness=2)
    ids = torch.tensor([1, 3, 4])
    first = cache.outgoing((ids, torch.ones(3, 3)), flush=False)
    assert first[0].tolist() == [1]  # rows 3 and 4 held back: 1 update each
    assert cache.outgoing((torch.tensor([3]), 2 * torch.ones(1, 3)), flush=False)[0].numel() == 0  # row 3: 2 = s
    third = cache.outgoing((torch.tensor([3, 5]), 4 * torch.ones(2, 3)), flush=False)
    assert third[0].tolist() == [5, 3] and third[1][:, 0].tolist() == [4.0, 7.0]  # row 3's third: due, summed
    assert cache.count.tolist() == [0, 1]
    assert cache.outgoing(None, flush=False) is None  # row 4 holds 1 <= s: stays
    with pytest.raises(AssertionError):  # an epoch may not start with gradients held back
        cache.new_epoch(cache.ids)
    last = cache.outgoing(None, flush=True)  # an epoch's end: everything held
    assert last[0].tolist() == [4] and last[1][:, 0].tolist() == [1.0]
    assert cache.outgoing(None, flush=True) is None  # nothing held, nothing given
    cache.new_epoch(cache.ids)
    passing = RowCache(_table(), torch.tensor([3, 4]), 2, staleness=0)  # s = 0: every row passes through
    grads = torch.arange(9.0).view(3, 3)
    out = passing.outgoing((torch.tensor([4, 1, 3]), grads), flush=False)
    assert out[0].tolist() == [4, 1, 3] and out[1] is not None and torch.equal(out[1], grads)


def test_the_cache_size_flag_takes_rows_or_a_fraction():
    assert CacheConfig(100, 1).rows_for(1000) == 100 and CacheConfig(0.25, 1).rows_for(1000) == 250
    assert CacheConfig(0, 1).rows_for(1000) == 100 and CacheConfig(5000, 1).rows_for(1000) == 1000


def test_predicted_shares_of_rows_looked_up_every_step():
    """Every worker looks each row up every step (p = 1): a worker pushes it every s + 1 steps
    (plus at most once an epoch), some worker pushes it with probability u = 1 - (1 - 1/(s+1))^N
    a step, and a pulled copy is read for s / u steps before the next pull."""
    hot = HotRows(ids=tuple(range(10)), counts=(8,) * 10, batches=8, touches=80)
    assert cache_shares(hot, 10, 0, 4) == (0.0, 1.0, 1.0)
    hit, pulled, pushed = cache_shares(hot, 10, 3, 4, epoch=100)
    reads = 3 / (1 - 0.75**4)
    assert hit == pytest.approx(reads / (reads + 1)) and pulled == pytest.approx(1 - hit)
    assert pushed == pytest.approx(0.25 + 0.75 / 100)
    half, _, half_pushed = cache_shares(hot, 5, 3, 4, epoch=100)  # half the rows cached
    assert half == pytest.approx(hit / 2) and half_pushed == pytest.approx(0.5 + pushed / 2)
    counts = torch.tensor([0, 5, 0, 9, 5])
    assert HotRows.from_counts(counts, 10).ids == (3, 1, 4) and HotRows.from_counts(counts, 10).touches == 19


def test_the_planner_lists_hybrid_with_the_cache_and_takes_it_only_when_asked():
    from test_planner import make_profile
    from hpar.strategies.plan.cluster import ClusterSpec
    from hpar.strategies.plan.planner import choose_plan
    from hpar.strategies.profile.profiler import LayerProfile, ParamProfile

    # 100 rows looked up by every batch, 900 by one batch in 8: the 100 are worth caching
    emb = ParamProfile(
        "emb.weight",
        (100_000, 256),
        102_400_000,
        True,
        0.002,
        0.016,
        True,
        layer=0,
        union_curve=((1, 0.002), (8, 0.016)),
        hot_rows=tuple(range(1000)),
        hot_counts=(8,) * 100 + (1,) * 900,
        hot_batches=8,
        hot_touches=1700,
    )
    dense = ParamProfile("lstm.weight", (100, 100), 40_000, False, 1.0, 1.0, False, layer=1)
    prof = make_profile(
        [emb, dense],
        [
            LayerProfile("emb", 0.001, 0.001, 0, 10, emb.bytes),
            LayerProfile("lstm", 0.004, 0.009, 10**8, 10, dense.bytes),
        ],
        0.005,
        0.01,
    )
    cluster = ClusterSpec(hosts=8, gpus_per_host=(1,) * 8, servers=8, bandwidth_Bps=1.25e7, latency_s=0.0)
    plain = choose_plan(prof, cluster)
    row = next(c for c in plain.candidates if c.strategy == "hybrid-cache")
    hybrid = next(c for c in plain.candidates if c.strategy == "hybrid")
    assert plain.strategy == "hybrid" and plain.cache == {}
    assert not row.available and "--staleness" in row.note and "s = 4" in row.note
    assert row.bytes_per_step < hybrid.bytes_per_step and 0 < row.breakdown["hit_rate"] < 1
    assert row.samples_per_s > hybrid.samples_per_s  # faster, and still not taken unasked
    asked = choose_plan(prof, cluster, cache=CacheConfig(100, 2))
    assert asked.strategy == "hybrid" and asked.cache["staleness"] == 2 and asked.cache["rows"] == 100
    assert asked.cache["hot_rows"] == {"emb.weight": list(range(100))}
    assert 0 < asked.cache["predicted_hit_rate"] < 2 / 3
    assert next(c for c in asked.candidates if c.strategy == "hybrid-cache").available
    exact = choose_plan(prof, cluster, cache=CacheConfig(100, 0))  # s = 0 saves nothing: hybrid wins the tie
    assert exact.cache == {} and exact.strategy == "hybrid"


def test_tune_names_the_cached_plan_hybrid_cache_and_tries_plain_hybrid_beside_it():
    """--tune's candidates (strategies/plan/tuning.py): a plan that runs hybrid with the caches is
    the hybrid-cache candidate, first; plain hybrid is another candidate, not the planner's."""
    import dataclasses
    from hpar.strategies.plan.tuning import candidates, planned_name
    from hpar.strategies.specs.decision import Candidate, Plan

    rows = [
        Candidate("hybrid", available=True, samples_per_s=900.0, predicted_step_s=0.02, bytes_per_step=0.0),
        Candidate("hybrid-cache", available=True, samples_per_s=1000.0, predicted_step_s=0.018, bytes_per_step=0.0),
        Candidate("allreduce", available=True, samples_per_s=100.0, predicted_step_s=0.2, bytes_per_step=0.0),
    ]
    cached = Plan(strategy="hybrid", cache={"staleness": 2}, candidates=rows)
    plain = dataclasses.replace(cached, cache={})
    assert planned_name(cached) == "hybrid-cache" and planned_name(plain) == "hybrid"
    assert [s for s, _ in candidates(cached)] == ["hybrid-cache", "hybrid"]
    assert [s for s, _ in candidates(plain)] == ["hybrid", "hybrid-cache"]
