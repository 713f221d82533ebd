"""The parameter server's wire format: one gloo message per request.

Transport: torch.distributed point-to-point over the default process group (gloo), where
workers hold pg ranks ``0..N-1`` and servers ``N..N+S-1`` (not torch.distributed.rpc, which
upstream keeps in maintenance mode).

A request is one uint8 message with tag ``TAG_REQUEST``: a header of ``HEADER_FIELDS`` int64
``(op, table id, n, step, count, inline)`` followed, when ``inline`` is 1, by its payload:
the ``n`` int64 row ids (pulls and pushes of rows) and then, for a push, the gradient rows
(``n x dim``, or every row of the server's shard when ``n = -1``). A payload larger than
``INLINE_MAX`` bytes goes as separate messages after the header instead (``inline`` 0, tag
``TAG_DATA``, ids first), so a server's receive buffer stays ``HEADER_BYTES + INLINE_MAX``.

Why one message: gloo's TCP transport sends a message only once the receiver has posted its
receive (a send-ready / receive-ready notification exchange between the two I/O threads,
unless the receive was posted first). A server can post the receive of a separate payload
only after it has read the header, so every separate payload cost one more such exchange,
three per push; on a host whose cores are all busy each exchange waits for two processes to
be scheduled. Pull answers need none: the worker posts the answer's receive before it sends
the request. (A ``PULL_CACHED`` answer is the rows followed by the freshness bits of the
worker's cached rows, strategies/runtimes/hybrid/versions.py: its size, too, is known to both ends.) (Measured in BENCHMARKS.md, section 1.) For the same reason a server keeps up
to ``INBOX_DEPTH`` receives posted for each worker, each naming its sender (:class:`Inbox`):
with one receive from any sender, the requests of different workers crossed the links into a
server one at a time, each after a round trip (BENCHMARKS.md, section 14).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from hpar.strategies.specs.servers_spec import INLINE_MAX

PULL, PUSH, DONE, FINISH = 1, 2, 3, 4
PULL_CACHED, CACHE = (
    5,
    6,
)  # the hot-row cache's (strategies/runtimes/hybrid/cache_client.py): a pull answered with bits, the rows cached
TAG_REQUEST, TAG_DATA, TAG_REPLY = 11, 12, 1000
HEADER_FIELDS = 6
HEADER_BYTES = HEADER_FIELDS * 8
CONTROL = "_control"  # byte-count key of DONE/FINISH messages


def p2p(group=None):
    """``(isend, irecv)`` on ``group`` (default: the default group), each ``f(tensor, peer,
    tag) -> Work``: the ProcessGroup's own point-to-point calls, which skip the argument
    checks of ``dist.isend``/``dist.irecv`` (half the cost of a small message here)."""
    pg = group or dist.group.WORLD
    return (lambda t, peer, tag: pg.send([t], peer, tag)), (lambda t, peer, tag: pg.recv([t], peer, tag))


def reply_tag(tid: int) -> int:
    """Tag of the server's answers to pulls of table ``tid``: one tag per table, because
    tables are applied (and so answered) in any order, while answers with one tag from one
    sender match the receiver's posted receives in order."""
    return TAG_REPLY + tid


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def encode(
    op: int,
    tid: int,
    n: int,
    step: int,
    count: int = 1,
    payload: tuple[torch.Tensor, ...] = (),
    inline_max: int = INLINE_MAX,
) -> tuple[torch.Tensor, list]:
    """``(request message, separate payloads)``: the payload tensors (ids, then rows) are
    copied behind the header when their total is at most ``inline_max`` bytes (separate
    payloads ``[]``); otherwise the message is the header alone and the tensors follow."""
    size = sum(nbytes(t) for t in payload)
    inline = size <= inline_max
    msg = torch.empty(HEADER_BYTES + (size if inline else 0), dtype=torch.uint8)
    msg[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([op, tid, n, step, count, int(inline)]))
    if not inline:
        return msg, [t.contiguous() for t in payload]
    offset = HEADER_BYTES
    for t in payload:
        b = nbytes(t)
        msg[offset : offset + b].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        offset += b
    return msg, []


@dataclass(frozen=True)
class Request:
    """A decoded request header; ``src`` is the sender's default-group rank."""

    src: int
    op: int
    tid: int
    n: int
    step: int
    count: int
    inline: bool


class Inbox:
    """A server's receive side: up to ``depth`` receives posted for each of the ``workers``
    workers (default-group ranks ``0..workers-1``), each into its own buffer of
    ``HEADER_BYTES + INLINE_MAX`` bytes, so that the requests of every worker cross the links
    into the server while it handles one (gloo moves a message only once its receive is posted).

    Receives name their sender: gloo then tells the sender its receive is ready when it is
    posted, and the request goes out as soon as it is made. A receive from any sender costs a
    round trip more per request (the sender announces the message, the receiver's answer
    releases it; gloo/transport/tcp/context.cc ``recvFromAny``), on a host whose cores are
    busy one more wait for two processes to be scheduled (BENCHMARKS.md, section 14). Gloo
    receives have no futures, so one thread per worker waits for that worker's receives in
    the order they were posted (gloo matches one sender's messages to them in the order it
    sent them) and queues each arrival; :meth:`next` takes the arrivals in the order they
    came, and on the following call posts that buffer again once its payload was copied out.

    Never more receives are posted for a worker than the messages it still owes for sure, so
    none is left posted at the end: each worker owes its FINISH and, once it sent DONE for
    step ``t`` of a run of ``steps`` steps (every worker sends DONE to every server every
    step), the DONEs of steps ``t+1 .. steps-1`` too. Without ``steps``, a worker owes its
    FINISH only. A worker's waiting thread ends with its FINISH. ``group``: the process group
    of the requests (default: the default group)."""

    def __init__(self, workers: int = 1, depth: int = 1, steps: int | None = None, group=None):
        assert workers >= 1 and depth >= 1
        self._irecv = p2p(group)[1]
        self._depth = depth
        self._steps = steps
        self._owed = [1] * workers  # messages each worker still sends for sure: its FINISH at least
        self._posted = [0] * workers  # receives posted per worker and not yet taken
        self._arrived: queue.SimpleQueue = queue.SimpleQueue()  # (sender, buffer, error) in arrival order
        self._to_wait = [queue.SimpleQueue() for _ in range(workers)]  # per worker: (buffer, Work), None to end
        self._threads = [
            threading.Thread(target=self._wait_loop, args=(src,), name=f"hpar-inbox-{src}", daemon=True)
            for src in range(workers)
        ]
        for thread in self._threads:
            thread.start()
        self._spare: list[torch.Tensor] = []
        self.buf: torch.Tensor | None = None
        self._offset = HEADER_BYTES

    def _wait_loop(self, src: int) -> None:
        """Worker ``src``'s thread: wait for its receives in posted order, queue each arrival
        (a failed receive too, with its error, and then end)."""
        while (item := self._to_wait[src].get()) is not None:
            buf, work = item
            try:
                work.wait()
            except Exception as exc:  # raised in the server's thread by next()
                self._arrived.put((src, buf, exc))
                return
            self._arrived.put((src, buf, None))

    def close(self, timeout_s: float = 10.0) -> None:
        """After every worker's FINISH: wait for the waiting threads to end (each was told to at
        its worker's FINISH), so none holds the process group when it is destroyed."""
        assert not any(self._owed), "closing the inbox before every worker's FINISH"
        for thread in self._threads:
            thread.join(timeout_s)

    def posted(self) -> int:
        """Receives posted and not yet taken, over all workers."""
        return sum(self._posted)

    def next(self) -> Request:
        """Block until the next request from any worker arrives; returns its header. Raises
        the receive's error (a worker's connection lost) as gloo raised it."""
        if self.buf is not None:  # the last request's payload was taken: its buffer is free
            self._spare.append(self.buf)
        for src, owed in enumerate(self._owed):
            while self._posted[src] < min(self._depth, owed):
                buf = self._spare.pop() if self._spare else torch.empty(HEADER_BYTES + INLINE_MAX, dtype=torch.uint8)
                self._to_wait[src].put((buf, self._irecv(buf, src, TAG_REQUEST)))
                self._posted[src] += 1
        assert any(self._posted), "a request after every worker's FINISH"
        src, self.buf, error = self._arrived.get()
        if error is not None:
            raise error
        self._posted[src] -= 1
        self._offset = HEADER_BYTES
        op, tid, n, step, count, inline = self.buf[:HEADER_BYTES].view(torch.int64).tolist()
        if op == FINISH:
            self._owed[src] = 0
            self._to_wait[src].put(None)
        elif op == DONE and self._steps is not None:
            self._owed[src] = self._steps - step  # the DONEs of steps step+1 .. steps-1, then FINISH
        return Request(src, op, tid, n, step, count, bool(inline))

    def take(self, req: Request, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The request's next payload tensor (its own memory), from the message or, for a
        request sent in parts, received from the sender now."""
        out = torch.empty(shape, dtype=dtype)
        size = nbytes(out)
        if req.inline:
            out.reshape(-1).view(torch.uint8).copy_(self.buf[self._offset : self._offset + size])
            self._offset += size
        elif size:
            self._irecv(out, req.src, TAG_DATA).wait()
        return out
