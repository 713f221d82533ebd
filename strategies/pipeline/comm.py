"""Point-to-point links of one pipeline stage to its neighbours (torch.distributed).

Stage k sends activations to k+1 and gradients to k-1, with ``isend`` (awaited at the end
of the step, when the tensors may be freed) and receives with blocking ``recv``. An
activation is preceded by a fixed-size int64 header (dtype code, number of dimensions,
shape), so shapes may change from batch to batch; a gradient has the shape of the
activation it answers, which the receiver remembers. The last stage sends each step's mean
loss to stage 0 (rank 0 reports it). Messages between a pair of stages in one direction are
all of one kind and keep their order, so no tags are needed beyond a kind per direction.

Counts bytes sent and received (headers included), the bytes sent to a stage on another
host, and seconds spent waiting in ``recv``
and in the end-of-step wait for sends: the stage's idle (bubble) time.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

MAX_DIMS = 8
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool, torch.uint8)
TAG_HEADER, TAG_ACT, TAG_GRAD, TAG_LOSS = 1, 2, 3, 4


class Links:
    """The messages of stage ``rank`` of ``world_size`` stages on ``device``; ``is_remote``
    tells whether a stage rank runs on another host."""

    def __init__(self, rank: int, world_size: int, device: torch.device,
                 is_remote: Callable[[int], bool] = lambda rank: False):
        self.rank, self.world_size, self.device, self.is_remote = rank, world_size, device, is_remote
        self.pending: list = []               # (work, tensor) of isends not yet awaited
        self.out_shapes: deque = deque()      # shapes/dtypes of activations sent, for their gradients
        self.sent = self.recv = self.sent_remote = 0
        self.idle = 0.0

    # --- activations forward ------------------------------------------------------------
    def send_activation(self, tensor: torch.Tensor) -> None:
        """Send ``tensor`` (any dtype in DTYPES, at most MAX_DIMS dims) to the next stage."""
        if tensor.dtype not in DTYPES or tensor.dim() > MAX_DIMS:
            raise ValueError(f"--strategy pipeline: stage {self.rank} outputs a {tensor.dtype} tensor of {tensor.dim()} dims; activations must have at most {MAX_DIMS} dims and a standard dtype")
        header = torch.zeros(MAX_DIMS + 2, dtype=torch.int64, device=self.device)
        header[0], header[1] = DTYPES.index(tensor.dtype), tensor.dim()
        if tensor.dim():
            header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        tensor = tensor.contiguous()
        self._isend(header, self.rank + 1, TAG_HEADER)
        self._isend(tensor, self.rank + 1, TAG_ACT)
        self.out_shapes.append((tensor.shape, tensor.dtype))

    def recv_activation(self) -> torch.Tensor:
        """The next activation from the previous stage."""
        header = torch.empty(MAX_DIMS + 2, dtype=torch.int64, device=self.device)
        self._recv(header, self.rank - 1, TAG_HEADER)
        dtype, ndim = DTYPES[int(header[0])], int(header[1])
        out = torch.empty(tuple(int(d) for d in header[2:2 + ndim]), dtype=dtype, device=self.device)
        self._recv(out, self.rank - 1, TAG_ACT)
        return out

    # --- gradients backward -------------------------------------------------------------
    def send_gradient(self, grad: torch.Tensor) -> None:
        """Send the gradient of this stage's input to the previous stage."""
        self._isend(grad.contiguous(), self.rank - 1, TAG_GRAD)

    def recv_gradient(self) -> torch.Tensor:
        """The gradient of the oldest activation sent whose gradient has not come back
        (1F1B and GPipe run backwards in forward order)."""
        shape, dtype = self.out_shapes.popleft()
        grad = torch.empty(shape, dtype=dtype, device=self.device)
        self._recv(grad, self.rank + 1, TAG_GRAD)
        return grad

    # --- loss to rank 0 -----------------------------------------------------------------
    def send_loss(self, loss: float) -> None:
        t = torch.tensor([loss], dtype=torch.float64, device=self.device)
        work = dist.isend(t, 0, tag=TAG_LOSS)
        self.pending.append((work, t))

    def recv_loss(self) -> float:
        t = torch.empty(1, dtype=torch.float64, device=self.device)
        t0 = time.perf_counter()
        dist.recv(t, self.world_size - 1, tag=TAG_LOSS)
        self.idle += time.perf_counter() - t0
        return float(t)

    # --- bookkeeping --------------------------------------------------------------------
    def wait_sends(self, keep: int = 0) -> None:
        """Free the isends that have completed, then wait for the oldest until at most
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

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.pending.append((dist.isend(tensor, dst, tag=tag), tensor))
        n = tensor.numel() * tensor.element_size()
        self.sent += n
        if self.is_remote(dst):
            self.sent_remote += n

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        t0 = time.perf_counter()
        dist.recv(tensor, src, tag=tag)
        self.idle += time.perf_counter() - t0
        self.recv += tensor.numel() * tensor.element_size()
