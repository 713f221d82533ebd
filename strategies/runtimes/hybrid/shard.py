"""Server-side shard of the parameter server: row partitions and sparse optimizers.

A PS-placed parameter is viewed as a table of ``rows x dim`` (an embedding weight as is; any
other tensor with its first dimension as rows and the rest flattened), cut into ``P`` contiguous
row ranges (partitions, as Parallax's partitioner does, Kim et al., "Parallax: Sparsity-aware
Data Parallel Training of Deep Neural Networks", EuroSys 2019); partition ``p`` lives on server
``(p + first) % S`` (round-robin from the table's first server, as TensorFlow places variables
over its PS tasks, so small tables do not all land on server 0). A server keeps its partitions
concatenated in one local tensor (:class:`RowLayout` maps global row ids to local ones).

Optimizers (:class:`ParamShard.apply`) run torch.optim's own functional updates of ``SGD``
(momentum, dampening, nesterov, weight decay), ``Adagrad`` and ``Adam``/``AdamW``, with the
gradient of one step being the *mean* over workers of their pushed row gradients (as the dense
AllReduce averages, so N workers equal one process on the concatenated batch). Sparse semantics
(``mode``):

- ``"exact"`` (default): the update equals the dense torch optimizer's on the whole shard. Only
  touched rows are computed where an untouched row's update is provably zero (plain SGD and
  Adagrad without weight decay); otherwise (momentum, Adam, weight decay) every row of the shard
  is updated each step the parameter had a gradient: O(rows) on the server, never on the network.
- ``"lazy"``: only touched rows' parameters and state change (TensorFlow's sparse ``apply`` ops,
  ``torch.optim.SparseAdam``); steps are counted per shard, so Adam's bias correction and
  Adagrad's lr decay follow the global step. Differs from dense training for momentum, Adam and
  weight decay on rows a step did not touch.

A step with no push at all for a parameter leaves it and its state alone, like a dense
optimizer skipping a parameter whose ``grad`` is None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim import adagrad, adam, sgd
from hpar.strategies.job.optimizer_rules import OptimizerSpec


@dataclass(frozen=True)
class RowLayout:
    """How ``num_rows`` rows are cut into ``num_partitions`` contiguous ranges spread
    round-robin over ``num_servers`` servers. Partition ``p`` holds rows
    ``[p*R//P, (p+1)*R//P)`` and lives on server ``(p + first_server) % S``; with fewer
    partitions than servers, only ``P`` servers hold rows of the table."""

    num_rows: int
    num_partitions: int
    num_servers: int
    first_server: int = 0

    def __post_init__(self):
        assert self.num_rows >= 1 and self.num_servers >= 1
        assert 1 <= self.num_partitions <= self.num_rows
        assert 0 <= self.first_server < self.num_servers
        p = torch.arange(self.num_partitions + 1, dtype=torch.int64)
        object.__setattr__(self, "_bounds", p * self.num_rows // self.num_partitions)
        object.__setattr__(self, "_owners", self._server_of_partition(p[:-1]))
        object.__setattr__(self, "_shifts", {})  # server -> local row id minus global, per partition

    @staticmethod
    def make(num_rows: int, partitions: int, num_servers: int, first_server: int = 0) -> "RowLayout":
        """A layout with ``partitions`` clamped to ``[1, num_rows]``, its partition 0 on
        server ``first_server % num_servers``."""
        return RowLayout(num_rows, max(1, min(int(partitions), num_rows)), num_servers, first_server % num_servers)

    def _server_of_partition(self, part: torch.Tensor) -> torch.Tensor:
        return (part + self.first_server) % self.num_servers

    def bounds(self) -> torch.Tensor:
        """int64 tensor of P+1 partition boundaries (row ids); do not modify it."""
        return self._bounds

    def partition_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Partition index of every global row id in ``ids`` (int64, any shape)."""
        return torch.searchsorted(self.bounds()[1:-1], ids, right=True)

    def server_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Owning server index of every global row id in ``ids``."""
        return self._server_of_partition(self.partition_of(ids))

    def server_rows(self, server: int) -> torch.Tensor:
        """Global row ids server ``server`` holds, in its local order (1-D int64)."""
        b = self.bounds().tolist()
        first = (server - self.first_server) % self.num_servers
        parts = [torch.arange(b[p], b[p + 1]) for p in range(first, self.num_partitions, self.num_servers)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def local_index(self, server: int, ids: torch.Tensor) -> torch.Tensor:
        """Local row index on ``server`` of global ``ids`` that it owns (asserted)."""
        if self.num_servers == 1:
            return ids
        part = self.partition_of(ids)
        assert bool((self._owners[part] == server).all()), "row ids sent to the wrong server"
        return ids + self._shift(server)[part]

    def _shift(self, server: int) -> torch.Tensor:
        """Per partition, ``server``'s local index of a row minus its global id (computed
        once per server: a request's ids map with one gather and one add)."""
        if server not in self._shifts:
            b = self.bounds()
            sizes = b[1:] - b[:-1]
            owned = (self._owners == server).to(torch.int64)
            self._shifts[server] = torch.cumsum(sizes * owned, 0) - sizes * owned - b[:-1]
        return self._shifts[server]


class ParamShard:
    """One server's rows of one parameter plus their optimizer state.

    ``weight`` is ``(local_rows, dim)`` float. Pushes accumulate with :meth:`add_grad`;
    :meth:`apply` then divides the summed gradient by ``num_workers`` (the mean over
    workers) and runs the optimizer (see the module docstring for the semantics).
    """

    def __init__(self, weight: torch.Tensor, spec: OptimizerSpec, copy: bool = True):
        assert weight.dim() == 2
        self.weight = weight.detach().clone() if copy else weight.detach()  # copy=False: the caller hands it over
        self.spec = spec
        self.step = 0
        self.state: dict[str, torch.Tensor] = {}
        self._ids: list[torch.Tensor] = []
        self._grads: list[torch.Tensor] = []
        self._senders: list[int] = []  # the rank of each push's worker, ascending (add_grad)
        self._pushed = False
        self.versions: torch.Tensor | None = None  # per-row update counts, for the workers' caches

    def track_versions(self) -> None:
        """Count the updates of each row from now on (``versions``, int64 per row: the clocks
        of the hot-row cache, strategies/runtimes/hybrid/versions.py)."""
        if self.versions is None:
            self.versions = torch.zeros(self.weight.shape[0], dtype=torch.int64)

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``local_ids`` (1-D int64) as a ``(n, dim)`` tensor; all rows when None."""
        return self.weight if local_ids is None else self.weight.index_select(0, local_ids)

    def add_grad(self, local_ids: torch.Tensor | None, grad: torch.Tensor, sender: int = 0) -> None:
        """Accumulate one worker's push: ``grad`` is ``(n, dim)`` for ``local_ids`` (n,),
        or ``(local_rows, dim)`` for every row when ``local_ids`` is None. An empty push
        still marks the parameter as having a gradient this step. The pushes are summed in
        the order of ``sender`` (the pushing worker's rank), not of arrival, so that a step's
        sum, and the training, do not depend on which worker's push came first (with 3 or
        more workers a float sum does)."""
        self._pushed = True
        if local_ids is None:
            local_ids = torch.arange(self.weight.shape[0])
        if local_ids.numel():
            at = sum(1 for s in self._senders if s <= sender)  # stable: equal senders keep arrival order
            self._senders.insert(at, sender)
            self._ids.insert(at, local_ids)
            self._grads.insert(at, grad.reshape(local_ids.numel(), -1))

    def apply(self, num_workers: int, spec: OptimizerSpec | None = None) -> None:
        """Apply this step's update with the mean gradient over ``num_workers`` under
        ``spec`` (this step's hyperparameters under an LR schedule; None: the shard's own);
        clears the accumulated pushes. Does nothing when no worker pushed this step."""
        spec = spec or self.spec
        self.apply_gradient(self.mean_gradient(num_workers, spec), spec)

    def apply_gradient(
        self, gradient: tuple[torch.Tensor | None, torch.Tensor] | None, spec: OptimizerSpec | None = None
    ) -> None:
        """Apply ``gradient`` (from :meth:`mean_gradient`, possibly scaled by a clipping
        coefficient) under ``spec``; None (no push this step) leaves the shard alone."""
        if gradient is None:
            return
        self.step += 1
        self._update(gradient[0], gradient[1], spec or self.spec)
        if self.versions is not None:  # the rows this update wrote: the touched ones, or every row
            if gradient[0] is None:
                self.versions += 1
            else:
                self.versions[gradient[0]] += 1

    def mean_gradient(
        self, num_workers: int, spec: OptimizerSpec | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """This step's gradient, the pushes summed and divided by ``num_workers``: ``(local
        rows (k,), (k, dim))`` when touched rows suffice for ``spec``'s update, else ``(None,
        (local_rows, dim))`` for every row; None when no worker pushed. Clears the pushes."""
        spec = spec or self.spec
        if not self._pushed:
            return None
        self._pushed = False
        ids_list, grads_list = self._ids, self._grads
        self._ids, self._grads, self._senders = [], [], []
        dim = self.weight.shape[1]
        if spec.touched_rows_suffice():
            ids = torch.cat(ids_list) if ids_list else torch.empty(0, dtype=torch.int64)
            rows, inverse = torch.unique(ids, return_inverse=True)
            g = self.weight.new_zeros(rows.numel(), dim)
            start = 0
            for grads in grads_list:  # sum the pushes without concatenating them first
                g.index_add_(0, inverse[start : start + grads.shape[0]], grads)
                start += grads.shape[0]
        else:
            rows = None
            g = torch.zeros_like(self.weight)
            for ids, grads in zip(ids_list, grads_list):
                g.index_add_(0, ids, grads)
        g.div_(num_workers)
        return rows, g

    def _state(self, key: str, fill: float = 0.0) -> torch.Tensor:
        if key not in self.state:
            self.state[key] = torch.full_like(self.weight, fill)
        return self.state[key]

    def _update(self, rows: torch.Tensor | None, g: torch.Tensor, s: OptimizerSpec) -> None:
        """Run torch.optim's functional update (the code ``SGD``/``Adagrad``/``Adam(W).step``
        runs; fused kernels where torch has them) on ``rows`` (None: every row) with
        gradient ``g`` under ``s``, then write the rows and their state back."""
        p = self.weight if rows is None else self.weight.index_select(0, rows)
        picked: dict[str, torch.Tensor] = {}

        def state(key: str, fill: float = 0.0) -> torch.Tensor:
            full = self._state(key, fill)
            picked[key] = full if rows is None else full.index_select(0, rows)
            return picked[key]

        # torch's functional updates count the step themselves (step_t += 1)
        step_t = torch.tensor(float(self.step - 1), device=p.device)
        fused = p.device.type == "cpu" and p.dtype == torch.float32
        if s.kind == "sgd":
            buf = [state("momentum_buffer") if "momentum_buffer" in self.state else None]
            sgd.sgd(
                [p],
                [g],
                buf,
                weight_decay=s.weight_decay,
                momentum=s.momentum,
                lr=s.lr,
                dampening=s.dampening,
                nesterov=s.nesterov,
                maximize=False,
            )
            if s.momentum and "momentum_buffer" not in self.state:  # created by the first step
                full = self._state("momentum_buffer")
                picked["momentum_buffer"] = buf[0] if rows is not None else full.copy_(buf[0])
        elif s.kind == "adagrad":
            adagrad.adagrad(
                [p],
                [g],
                [state("sum", s.initial_accumulator_value)],
                [step_t],
                fused=fused,
                lr=s.lr,
                weight_decay=s.weight_decay,
                lr_decay=s.lr_decay,
                eps=s.eps,
                maximize=False,
            )
        else:
            adam.adam(
                [p],
                [g],
                [state("exp_avg")],
                [state("exp_avg_sq")],
                [],
                [step_t],
                fused=fused,
                decoupled_weight_decay=s.decoupled_weight_decay,
                amsgrad=False,
                beta1=s.betas[0],
                beta2=s.betas[1],
                lr=s.lr,
                weight_decay=s.weight_decay,
                eps=s.eps,
                maximize=False,
            )
        if rows is not None:
            self.weight.index_copy_(0, rows, p)
            for key, value in picked.items():
                self.state[key].index_copy_(0, rows, value)

    def state_dict(self) -> dict:
        """Weight, step and optimizer state (for checkpoints)."""
        return {
            "weight": self.weight.clone(),
            "step": self.step,
            "state": {k: v.clone() for k, v in self.state.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; raises ValueError on a shape mismatch."""
        if tuple(state["weight"].shape) != tuple(self.weight.shape):
            raise ValueError(
                f"checkpoint shard has shape {tuple(state['weight'].shape)}, expected "
                f"{tuple(self.weight.shape)}; resume with the same --servers and plan"
            )
        self.weight.copy_(state["weight"])
        self.step = int(state["step"])
        self.state = {k: v.clone() for k, v in state["state"].items()}


def table_view(t: torch.Tensor) -> torch.Tensor:
    """A parameter as a ``(rows, dim)`` table: first dimension as rows, the rest flattened
    (a scalar is one row of one column)."""
    if t.dim() == 0:
        return t.reshape(1, 1)
    return t.reshape(t.shape[0], -1)
