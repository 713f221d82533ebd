"""The parameter server's wire format between two real gloo processes: requests carried in
one message and requests too large for it, sent in parts, decode to the same tensors."""

import contextlib
import multiprocessing as mp
import os

import torch

from hpar.strategies.runtimes.hybrid import wire as ps_wire
from hpar.strategies.plan.cluster import free_port
from hpar.strategies.specs.decision import Plan


def _payload(n: int, dim: int):
    ids = torch.arange(n, dtype=torch.int64) * 3 + 1
    rows = torch.arange(n * dim, dtype=torch.float32).reshape(n, dim) / 7
    return ids, rows


CASES = [  # (op, tid, n, dim, inline_max): the last is too large for one message
    (ps_wire.PULL, 0, 5, 0, ps_wire.INLINE_MAX),
    (ps_wire.PUSH, 2, 6, 4, ps_wire.INLINE_MAX),
    (ps_wire.PUSH, 1, 0, 4, ps_wire.INLINE_MAX),
    (ps_wire.DONE, -1, 0, 0, ps_wire.INLINE_MAX),
    (ps_wire.PUSH, 3, 9, 5, 64),
]


@contextlib.contextmanager
def _gloo(rank: int, port: int, world_size: int):
    """This spawned child as ``rank`` of a gloo group of ``world_size`` on 127.0.0.1:``port``
    (one CPU thread); a barrier, then the group is destroyed, on leaving the block."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _child(rank: int, port: int, out):
    with _gloo(rank, port, 2):
        if rank == 0:
            isend = ps_wire.p2p()[0]
            works = []
            for op, tid, n, dim, inline_max in CASES:
                ids, rows = _payload(n, dim)
                payload = () if op == ps_wire.DONE else ((ids,) if op == ps_wire.PULL else (ids, rows))
                msg, separate = ps_wire.encode(op, tid, n, 7, 2, payload, inline_max=inline_max)
                works.append(isend(msg, 1, ps_wire.TAG_REQUEST))
                works += [isend(t, 1, ps_wire.TAG_DATA) for t in separate]
            for w in works:
                w.wait()
        else:
            inbox = ps_wire.Inbox()
            got = []
            for op, tid, n, dim, _ in CASES:
                req = inbox.next()
                ids = inbox.take(req, (req.n,), torch.int64) if req.op in (ps_wire.PULL, ps_wire.PUSH) else None
                rows = inbox.take(req, (req.n, dim), torch.float32) if req.op == ps_wire.PUSH else None
                got.append(
                    (
                        req.src,
                        req.op,
                        req.tid,
                        req.n,
                        req.step,
                        req.count,
                        req.inline,
                        None if ids is None else ids.tolist(),
                        None if rows is None else rows.tolist(),
                    )
                )
            out.put(got)  # plain lists: a tensor would share memory with a process about to exit


@contextlib.contextmanager
def _children(ctx, target, n: int, *args):
    """n spawned processes running ``target(rank, *args)``; on leaving the block each must have
    exited 0, and any still alive is killed (only these processes)."""
    procs = [ctx.Process(target=target, args=(r, *args)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        yield procs
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def test_requests_decode_inline_and_in_parts():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    with _children(ctx, _child, 2, port, out):
        got = out.get(timeout=60)
    assert len(got) == len(CASES)
    for (op, tid, n, dim, inline_max), (src, gop, gtid, gn, step, count, inline, ids, rows) in zip(CASES, got):
        assert (src, gop, gtid, gn, step, count) == (0, op, tid, n, 7, 2)
        assert inline == (inline_max == ps_wire.INLINE_MAX)
        want_ids, want_rows = _payload(n, dim)
        if op in (ps_wire.PULL, ps_wire.PUSH):
            assert ids == want_ids.tolist()
        if op == ps_wire.PUSH:
            assert rows == want_rows.tolist()


def test_encode_puts_payload_behind_the_header():
    ids, rows = _payload(3, 2)
    msg, separate = ps_wire.encode(ps_wire.PUSH, 4, 3, 9, 1, (ids, rows))
    assert separate == []
    assert msg.numel() == ps_wire.HEADER_BYTES + 3 * 8 + 3 * 2 * 4
    assert msg[: ps_wire.HEADER_BYTES].view(torch.int64).tolist() == [ps_wire.PUSH, 4, 3, 9, 1, 1]
    assert torch.equal(msg[ps_wire.HEADER_BYTES : ps_wire.HEADER_BYTES + 24].view(torch.int64), ids)
    big, separate = ps_wire.encode(ps_wire.PUSH, 4, 3, 9, 1, (ids, rows), inline_max=8)
    assert big.numel() == ps_wire.HEADER_BYTES and big.view(torch.int64)[-1] == 0
    assert [torch.equal(a, b) for a, b in zip(separate, (ids, rows))] == [True, True]


def _inbox_child(rank: int, port: int, out, go):
    """Ranks 0 and 1 are workers, rank 2 a server taking one request with one receive posted
    per worker."""
    import threading

    with _gloo(rank, port, 3):
        if rank < 2:
            isend = ps_wire.p2p()[0]
            first = isend(ps_wire.encode(ps_wire.PULL, 0, 0, 0, 1, ())[0], 2, ps_wire.TAG_REQUEST)
            done = threading.Event()  # (a gloo send's is_completed() stays False until wait())
            waiter = threading.Thread(target=lambda: (first.wait(), done.set()), daemon=True)
            waiter.start()
            out.put(("sent", rank, done.wait(5.0)))
            go.wait(60)  # the server took one request and waited for both reports
            waiter.join(60)
            later = [
                isend(ps_wire.encode(op, 0, 0, step, 1, ())[0], 2, ps_wire.TAG_REQUEST)
                for op, step in ((ps_wire.PUSH, 1), (ps_wire.DONE, 2), (ps_wire.FINISH, 3))
            ]
            for w in later:
                w.wait()
        else:
            inbox = ps_wire.Inbox(2, 1)
            got = [inbox.next()]
            go.wait(60)
            while len(got) < 8:
                got.append(inbox.next())
            inbox.close()  # its waiting threads end before the group is destroyed (else gloo may abort)
            out.put(("server", [(r.src, r.step) for r in got], inbox.posted()))


def test_a_server_takes_every_workers_first_request_at_once():
    """With a receive posted for each worker, both workers' first requests cross into the
    server while it handles one (gloo completes a send only once its receive is posted; with
    one receive from any sender, the second waited). Each worker's requests come out in the
    order it sent them, and no receive is left posted after the last FINISH."""
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    with _children(ctx, _inbox_child, 3, free_port(), out, go):
        sent = [out.get(timeout=60) for _ in range(2)]
        go.set()
        _, order, left_posted = out.get(timeout=60)
    assert all(done for *_, done in sent), sent
    for rank in (0, 1):
        assert [step for src, step in order if src == rank] == [0, 1, 2, 3], order
    assert left_posted == 0


def _lost_child(rank: int, port: int, out):
    """Rank 0 a worker that sends one request and dies; rank 1 a server waiting for more."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 0:
        ps_wire.p2p()[0](ps_wire.encode(ps_wire.PULL, 0, 0, 0, 1, ())[0], 1, ps_wire.TAG_REQUEST).wait()
        os._exit(0)  # no FINISH, no goodbye: the connection closes under the server
    inbox = ps_wire.Inbox(1, 4)
    first = inbox.next()
    try:
        inbox.next()
        out.put((first.op, "returned"))
    except RuntimeError as exc:
        out.put((first.op, type(exc).__name__))
    out.close()
    out.join_thread()  # the queue's feeder thread delivers before the hard exit
    os._exit(0)  # (the group cannot be left cleanly: its peer is gone)


def test_a_server_whose_worker_is_lost_raises_instead_of_waiting():
    """The receives are waited on in threads: a lost worker's connection error still reaches
    the server's loop as the exception gloo raised."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with _children(ctx, _lost_child, 2, free_port(), out):
        first_op, outcome = out.get(timeout=60)
    assert (first_op, outcome) == (ps_wire.PULL, "RuntimeError")


def _owed_child(rank: int, port: int, out):
    """Ranks 0 and 1 are workers of a 3-step run sending a pull, DONE of steps 0-2 and FINISH
    at once; rank 2 a server allowed 8 receives posted."""
    with _gloo(rank, port, 3):
        if rank < 2:
            isend = ps_wire.p2p()[0]
            sends = [(ps_wire.PULL, 0)] + [(ps_wire.DONE, step) for step in range(3)] + [(ps_wire.FINISH, 0)]
            for work in [isend(ps_wire.encode(op, 0, 0, step, 1, ())[0], 2, ps_wire.TAG_REQUEST) for op, step in sends]:
                work.wait()
        else:
            inbox = ps_wire.Inbox(2, 8, steps=3)
            got, most = [], 0
            while len(got) < 10:
                got.append(inbox.next())
                most = max(most, inbox.posted() + 1)  # posted when this one was taken
            out.put(([(r.src, r.op, r.step) for r in got], most, inbox.posted()))


def test_a_server_posts_as_many_receives_as_the_workers_still_owe():
    """Once a worker sent DONE for step 0 of 3, it owes two more DONEs and its FINISH, so the
    server posts up to 6 receives for 2 workers (not 2); each worker's requests still come
    out in the order it sent them, and none is left posted after the last FINISH."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with _children(ctx, _owed_child, 3, free_port(), out):
        order, most, left_posted = out.get(timeout=60)
    for rank in (0, 1):
        assert [(op, step) for src, op, step in order if src == rank] == [
            (ps_wire.PULL, 0),
            (ps_wire.DONE, 0),
            (ps_wire.DONE, 1),
            (ps_wire.DONE, 2),
            (ps_wire.FINISH, 0),
        ]
    assert 2 < most <= 6 and left_posted == 0


def _early_child(rank: int, port: int, out, sent):
    """Ranks 0 and 1 are workers of a one-table SGD job, rank 2 its server. Worker 1 finishes
    step 0 and pushes nothing for step 1 (it looked up no row of this server, but a push goes to
    every server holding rows) before worker 0's push of step 0 is sent."""
    import time
    from torch import nn
    from hpar.strategies.job.config import RunConfig
    from hpar.strategies.runtimes.hybrid.client import PSClient, ps_tables
    from hpar.strategies.runtimes.hybrid.ps_server import Server

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 2))
    tables = ps_tables(model, torch.optim.SGD(model.parameters(), lr=0.1), "hybrid", Plan(), 1)
    with _gloo(rank, port, 3):
        if rank == 2:
            cfg = RunConfig(
                script="<test>",
                strategy="hybrid",
                world_size=2,
                steps=2,
                batch_size=1,
                lr=0.1,
                seed=0,
                run_dir="",
                log_every=2,
            )
            server = Server(cfg, tables, model, 0, 2)
            server.serve()
            out.put(("server", server.shards[0].weight.tolist(), server.table_step[0]))
            return
        client, table, ones = PSClient(tables, 2, 1), tables[0], torch.ones(1, 2)
        if rank == 1:
            for w in client.push(table, torch.tensor([1]), ones, 0) + client.done(0):
                w.wait()
            for w in client.push(table, torch.empty(0, dtype=torch.int64), torch.empty(0, 2), 1):
                w.wait()
            sent.set()
            for w in client.done(1):
                w.wait()
        else:
            sent.wait(60)
            time.sleep(0.5)  # the server has taken worker 1's push of step 1 by now
            for w in client.push(table, torch.tensor([2]), ones, 0) + client.done(0):
                w.wait()
            out.put(("pulled", client.pull(table, torch.tensor([1, 2]), 1).tolist()))
            for w in client.push(table, torch.tensor([1]), ones, 1) + client.done(1):
                w.wait()
        client.finish()


def test_a_push_ahead_of_its_table_waits_for_the_step_before():
    """A worker's empty push of step t+1 (to a server holding rows of the table that it pulled
    none of) can reach the server before another worker's push of step t: the server keeps it
    until the table's step t is applied, instead of failing, and every update comes out as the
    mean of the workers' gradients of its own step (SGD, lr 0.1, two workers)."""
    ctx = mp.get_context("spawn")
    out, sent = ctx.Queue(), ctx.Event()
    torch.manual_seed(0)
    w0 = torch.nn.Embedding(8, 2).weight.detach()
    with _children(ctx, _early_child, 3, free_port(), out, sent):
        got = dict((k, v) for k, *v in (out.get(timeout=60) for _ in range(2)))
    after0 = w0.clone()
    after0[[1, 2]] -= 0.1 * 0.5
    assert torch.allclose(torch.tensor(got["pulled"][0]), after0[[1, 2]])
    final = after0.clone()
    final[1] -= 0.1 * 0.5
    weights, at = got["server"]
    assert at == 2 and torch.allclose(torch.tensor(weights), final)
