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
the request. (Measured in BENCHMARKS.md, section 1.) For the same reason a server keeps a
receive posted for up to ``INBOX_DEPTH`` requests (:class:`Inbox`): with one, the requests of
different workers crossed the links into a server one at a time (BENCHMARKS.md, section 14).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

PULL, PUSH, DONE, FINISH = 1, 2, 3, 4
TAG_REQUEST, TAG_DATA, TAG_REPLY = 11, 12, 1000
HEADER_FIELDS = 6
HEADER_BYTES = HEADER_FIELDS * 8
INLINE_MAX = 4 << 20      # bytes of payload carried in the request message itself
INBOX_DEPTH = 16          # a server's receives posted at once (one buffer of INLINE_MAX each)
CONTROL = "_control"      # byte-count key of DONE/FINISH messages


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


def encode(op: int, tid: int, n: int, step: int, count: int = 1,
           payload: tuple[torch.Tensor, ...] = (), inline_max: int = INLINE_MAX) -> tuple[torch.Tensor, list]:
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
        msg[offset:offset + b].copy_(t.contiguous().reshape(-1).view(torch.uint8))
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
    """A server's receive side: up to ``depth`` receives from any of ``workers`` workers
    posted at once, each into its own buffer of ``HEADER_BYTES + INLINE_MAX`` bytes, so that
    that many requests cross the links into the server together instead of one after another
    (gloo moves a message only once its receive is posted). :meth:`next` takes the oldest
    posted receive (gloo matches one sender's messages to posted receives in the order it sent
    them, so its requests are handled in that order) and, on the following call, posts that
    buffer again once its payload was copied out.

    Never more receives are posted than messages the workers still owe for sure, so none is
    left posted at the end: each worker owes its FINISH and, once it sent DONE for step ``t``
    of a run of ``steps`` steps (every worker sends DONE to every server every step), the
    DONEs of steps ``t+1 .. steps-1`` too. Each message taken lowers that count by at most
    one, as it takes one posted receive. Without ``steps``, a worker owes its FINISH only."""

    def __init__(self, workers: int = 1, depth: int = 1, steps: int | None = None):
        assert workers >= 1 and depth >= 1
        self._irecv = p2p()[1]
        self._depth = depth
        self._steps = steps
        self._owed: dict[int, int] = {}   # sender rank -> messages it still sends for sure, once it sent one
        self._unseen = workers            # workers not heard from: each owes its FINISH
        self._posted: list[tuple[torch.Tensor, object]] = []   # (buffer, Work), oldest first
        self._spare: list[torch.Tensor] = []
        self.buf: torch.Tensor | None = None
        self._offset = HEADER_BYTES

    def _post(self, buf: torch.Tensor) -> None:
        self._posted.append((buf, dist.group.WORLD.recv_anysource([buf], TAG_REQUEST)))

    def owed(self) -> int:
        """Messages the workers will still send for sure (see the class docstring)."""
        return self._unseen + sum(self._owed.values())

    def next(self) -> Request:
        """Block until the next request from any worker arrives; returns its header."""
        if self.buf is not None:   # the last request's payload was taken: its buffer is free
            self._spare.append(self.buf)
        while len(self._posted) < min(self._depth, self.owed()):
            self._post(self._spare.pop() if self._spare else torch.empty(HEADER_BYTES + INLINE_MAX, dtype=torch.uint8))
        assert self._posted, "a request after every worker's FINISH"
        self.buf, work = self._posted.pop(0)
        work.wait()
        self._offset = HEADER_BYTES
        op, tid, n, step, count, inline = self.buf[:HEADER_BYTES].view(torch.int64).tolist()
        src = work.source_rank()
        if src not in self._owed:
            self._unseen -= 1
            self._owed[src] = 1
        if op == FINISH:
            self._owed[src] = 0
        elif op == DONE and self._steps is not None:
            self._owed[src] = self._steps - step   # the DONEs of steps step+1 .. steps-1, then FINISH
        return Request(src, op, tid, n, step, count, bool(inline))

    def take(self, req: Request, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The request's next payload tensor (its own memory), from the message or, for a
        request sent in parts, received from the sender now."""
        out = torch.empty(shape, dtype=dtype)
        size = nbytes(out)
        if req.inline:
            out.reshape(-1).view(torch.uint8).copy_(self.buf[self._offset:self._offset + size])
            self._offset += size
        elif size:
            self._irecv(out, req.src, TAG_DATA).wait()
        return out
