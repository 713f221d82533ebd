"""Point-to-point links of one pipeline stage to its neighbours (torch.distributed).

Stage k sends activations to k+1 and gradients to k-1. Two channels (strategies/common/groups.py):

* ``dense``: activations and gradients, on the worker's device, over the workers' dense group
  (NCCL on CUDA, gloo on CPU);
* ``host``: small CPU values over the default gloo group: the int64 header in front of each
  activation (dtype code, number of dimensions, shape: shapes may change from batch to batch,
  and the receiver reads it without a device synchronisation) and each step's mean loss, which
  the last stage sends to stage 0 of its pipeline (rank 0 reports it).

Deadlock freedom (NCCL): a send between two GPUs does not complete until the peer's matching
receive runs, and one pair's sends and receives run in order on one stream. With 1F1B, stage
k would send activation j+1 before receiving gradient j while stage k+1 sends gradient j
before receiving activation j+1: both wait forever. So sends are not posted on their own:
they are queued and posted together with this stage's next receive in one
``dist.batch_isend_irecv`` (one NCCL group, whose operations progress together), or at the
end of a step (:meth:`Links.flush`). tests/test_pipeline_comm.py drives these links for every
schedule, K = 2..8 stages and M = 1..8 micro-batches, and checks that the posted batches
cannot deadlock even when every send blocks until its receive is posted.

A gradient has the shape of the activation it answers, which the sender remembers. Between
a pair of stages each channel carries one kind of message per direction, in order, so NCCL's
tag-less matching pairs them correctly. Counts bytes sent and received (headers included),
the bytes sent to a stage on another host, and seconds spent waiting for receives and for
sends at the end of a step: the stage's idle (bubble) time (host clock; on CUDA the waits
are stream waits, and runtime.py times compute with CUDA events).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

MAX_DIMS = 8
MAX_TENSORS = 16  # tensors of one tuple activation (a traced model's live values)
TUPLE = 99  # header code of a tuple activation
DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
)
TAG_HEADER, TAG_ACT, TAG_GRAD, TAG_LOSS = 1, 2, 3, 4
DENSE, HOST = "dense", "host"


def _header(tensor: torch.Tensor, stage: int) -> torch.Tensor:
    """dtype code, number of dimensions, shape: MAX_DIMS + 2 int64 values in host memory."""
    if tensor.dtype not in DTYPES or tensor.dim() > MAX_DIMS:
        raise ValueError(
            f"--strategy pipeline: stage {stage} outputs a {tensor.dtype} tensor of {tensor.dim()} dims; activations must have at most {MAX_DIMS} dims and a standard dtype"
        )
    header = torch.zeros(MAX_DIMS + 2, dtype=torch.int64)
    header[0], header[1] = DTYPES.index(tensor.dtype), tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


@dataclass(frozen=True)
class P2P:
    """One point-to-point operation: ``op`` "send" or "recv", the tensor, the peer's default-group
    rank, the tag and the channel (``DENSE`` or ``HOST``)."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int
    channel: str


class TorchTransport:
    """Posts a batch of P2P operations with torch.distributed: the ``dense`` ones in one
    ``dist.batch_isend_irecv`` on ``group``, the ``host`` ones with gloo isend/irecv on the
    default group. Returns one Work per operation, in order."""

    def __init__(self, group=None):
        self.group = group

    def post(self, ops: list[P2P]) -> list:
        works = [None] * len(ops)
        dense = [i for i, o in enumerate(ops) if o.channel == DENSE]
        for i, o in enumerate(ops):
            if o.channel == HOST:
                fn = dist.isend if o.op == "send" else dist.irecv
                works[i] = fn(o.tensor, o.peer, tag=o.tag)
        if dense:
            p2p = [
                dist.P2POp(
                    dist.isend if ops[i].op == "send" else dist.irecv,
                    ops[i].tensor,
                    ops[i].peer,
                    group=self.group,
                    tag=ops[i].tag,
                )
                for i in dense
            ]
            for i, w in zip(dense, dist.batch_isend_irecv(p2p)):
                works[i] = w
        return works


class Links:
    """The messages of stage ``rank`` of ``world_size`` stages on ``device``; ``ranks``: the
    default-group ranks of this pipeline's stages 0..K-1 (default ``0..world_size-1``; one
    replica's pipeline under pipeline x data parallelism, strategies/runtimes/pipeline/replicas.py);
    ``is_remote`` tells whether a default-group rank runs on another host; ``transport``
    posts batches (default: :class:`TorchTransport` over ``group``, the workers' dense group)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        is_remote: Callable[[int], bool] = lambda rank: False,
        group=None,
        transport=None,
        ranks: list[int] | None = None,
    ):
        self.rank, self.world_size, self.device, self.is_remote = rank, world_size, device, is_remote
        self.peer = list(ranks) if ranks is not None else list(range(world_size))  # stage -> default-group rank
        self.transport = transport or TorchTransport(group)
        self.queue: list[P2P] = []  # sends not yet posted
        self.pending: list = []  # (work, tensor) of posted sends not yet awaited
        self.out_shapes: deque = deque()  # shapes/dtypes of activations sent, for their gradients
        self.sent = self.recv = self.sent_remote = 0
        self.idle = 0.0

    # --- activations forward ------------------------------------------------------------
    def send_activation(self, value) -> None:
        """Queue ``value`` for the next stage: a tensor (any dtype in DTYPES, at most MAX_DIMS
        dims), or a tuple of at most MAX_TENSORS of them (a traced model's live values), whose
        tensors with ``requires_grad`` get a gradient back."""
        if isinstance(value, tuple):
            if not 0 < len(value) <= MAX_TENSORS:
                raise ValueError(
                    f"--strategy pipeline: stage {self.rank} outputs {len(value)} tensors; at most "
                    f"{MAX_TENSORS} may cross a stage boundary"
                )
            header = torch.zeros(MAX_DIMS + 2, dtype=torch.int64)
            header[0], header[1] = TUPLE, len(value)
            rows = torch.zeros(len(value), MAX_DIMS + 3, dtype=torch.int64)
            for i, t in enumerate(value):
                rows[i, 0] = int(t.requires_grad)
                rows[i, 1:] = _header(t, self.rank)
            self._queue(header, self.peer[self.rank + 1], TAG_HEADER, HOST)
            self._queue(rows.flatten(), self.peer[self.rank + 1], TAG_HEADER, HOST)
            for t in value:
                self._queue(t.detach().contiguous(), self.peer[self.rank + 1], TAG_ACT, DENSE)
            self.out_shapes.append([(t.shape, t.dtype) for t in value if t.requires_grad])
            return
        header = _header(value, self.rank)  # host memory: read without a device sync
        tensor = value.contiguous()
        self._queue(header, self.peer[self.rank + 1], TAG_HEADER, HOST)
        self._queue(tensor, self.peer[self.rank + 1], TAG_ACT, DENSE)
        self.out_shapes.append((tensor.shape, tensor.dtype))

    def recv_activation(self):
        """The next activation from the previous stage (posted with the queued sends): a
        tensor, or a tuple whose tensors that need a gradient back have ``requires_grad``."""
        header = torch.empty(MAX_DIMS + 2, dtype=torch.int64)
        self._post([P2P("recv", header, self.peer[self.rank - 1], TAG_HEADER, HOST)])
        if int(header[0]) != TUPLE:
            return self._recv_tensor(header)
        rows = torch.empty(int(header[1]) * (MAX_DIMS + 3), dtype=torch.int64)
        self._post([P2P("recv", rows, self.peer[self.rank - 1], TAG_HEADER, HOST)])
        rows = rows.view(int(header[1]), MAX_DIMS + 3)
        return tuple(self._recv_tensor(row[1:]).requires_grad_(bool(row[0])) for row in rows)

    def _recv_tensor(self, header: torch.Tensor) -> torch.Tensor:
        dtype, ndim = DTYPES[int(header[0])], int(header[1])
        out = torch.empty(tuple(int(d) for d in header[2 : 2 + ndim]), dtype=dtype, device=self.device)
        self._post([P2P("recv", out, self.peer[self.rank - 1], TAG_ACT, DENSE)])
        return out

    # --- gradients backward -------------------------------------------------------------
    def send_gradient(self, grad) -> None:
        """Queue the gradient of this stage's input for the previous stage (a tuple: one per
        received tensor that needed one, in order)."""
        for g in grad if isinstance(grad, tuple) else (grad,):
            self._queue(g.contiguous(), self.peer[self.rank - 1], TAG_GRAD, DENSE)

    def recv_gradient(self):
        """The gradient of the oldest activation sent whose gradient has not come back
        (1F1B and GPipe run backwards in forward order); a tuple for a tuple activation."""
        shapes = self.out_shapes.popleft()
        many = isinstance(shapes, list)
        grads = []
        for shape, dtype in shapes if many else [shapes]:
            grad = torch.empty(shape, dtype=dtype, device=self.device)
            self._post([P2P("recv", grad, self.peer[self.rank + 1], TAG_GRAD, DENSE)])
            grads.append(grad)
        return tuple(grads) if many else grads[0]

    # --- loss to stage 0 (host channel) -------------------------------------------------
    def send_loss(self, loss: float) -> None:
        self.flush()
        self._post([], [P2P("send", torch.tensor([loss], dtype=torch.float64), self.peer[0], TAG_LOSS, HOST)])

    def recv_loss(self) -> float:
        t = torch.empty(1, dtype=torch.float64)
        self.flush()
        self._post([P2P("recv", t, self.peer[-1], TAG_LOSS, HOST)])
        return float(t)

    # --- bookkeeping --------------------------------------------------------------------
    def flush(self) -> None:
        """Post the queued sends (end of a step: no receive of this stage follows in it)."""
        if self.queue:
            self._post([])

    def wait_sends(self, keep: int = 0) -> None:
        """Free the sends that have completed, then wait for the oldest until at most
        ``keep`` remain (0: wait for all). Keeping a few lets a stage go on at the end of a
        step without waiting for its neighbour to pick up its last message."""
        t0 = time.perf_counter()
        while self.pending and (len(self.pending) > keep or self.pending[0][0].is_completed()):
            self.pending.pop(0)[0].wait()
        self.idle += time.perf_counter() - t0

    def take(self) -> tuple[int, int, float, int]:
        """(bytes sent, bytes received, idle seconds, bytes sent to another host) since the
        last call; resets them."""
        out = (self.sent, self.recv, self.idle, self.sent_remote)
        self.sent = self.recv = self.sent_remote = 0
        self.idle = 0.0
        return out

    def _queue(self, tensor: torch.Tensor, dst: int, tag: int, channel: str) -> None:
        self.queue.append(P2P("send", tensor, dst, tag, channel))
        n = tensor.numel() * tensor.element_size()
        self.sent += n
        if self.is_remote(dst):
            self.sent_remote += n

    def _post(self, recvs: list[P2P], sends: list[P2P] = ()) -> None:
        """Post the queued sends, ``sends`` and ``recvs`` as one batch; wait for the receives."""
        ops, self.queue = self.queue + list(sends) + recvs, []
        works = self.transport.post(ops)
        t0 = time.perf_counter()
        for o, w in zip(ops, works):
            if o.op == "send":
                self.pending.append((w, o.tensor))
            else:
                w.wait()
                if o.tag != TAG_LOSS:  # the loss is reporting, not pipeline traffic
                    self.recv += o.tensor.numel() * o.tensor.element_size()
        self.idle += time.perf_counter() - t0
