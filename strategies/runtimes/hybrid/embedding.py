"""Serve the user's nn.Embedding / nn.EmbeddingBag modules from the parameter server, without
the user changing the model.

:func:`attach` replaces the ``forward`` of each PS-placed embedding *instance* (the class stays
the user's): the new forward deduplicates the ids of its input, pulls those rows from the
servers for the current step, and looks up locally in the pulled ``(k, dim)`` rows with the same
``F.embedding`` / ``F.embedding_bag`` call on the remapped ids. The pulled rows are a leaf
tensor; after backward its ``.grad`` holds exactly the row gradients to push (summed per row
over several calls of one module in a step). The module's own ``weight`` is emptied and frozen,
so DDP ignores it; :func:`detach` restores a full weight and the class's forward.

Rows are requested ahead of the lookup where the batch gives their ids (``ahead.prefetch``,
``ahead.PullAhead``, ``ahead.complete``: docs/strategies.md, "Pulls ahead"), and with
``StepClock.on_gradients`` set a module's gradients are handed over from inside the backward
pass once every lookup of the step has its gradient (a post-accumulate-grad hook), so an output
embedding's push overlaps the backward of the layers below it.

Compiled models: the served forward is wrapped in ``torch.compiler.disable`` (a graph break:
dynamo cannot trace the client's ``pg.recv`` on a gloo group, ``UnsafeScriptObjectError``), so
the pull, the dedup and the lookup run eagerly and the rest of the user's forward stays
compiled; the lookup's output joins the compiled graphs through autograd as any input does. The
surgery is on the module the user wrote (``_orig_mod``, ``strategies/job/forward.inner_module``);
``fullgraph=True``, which forbids the break, is refused before start (:func:`check_fullgraph`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hpar.strategies.common.devices import copy_to_host
from hpar.strategies.runtimes.hybrid.ahead import batch_leaves, complete, covering_leaf, dedup_checked, in_rows
from hpar.strategies.runtimes.hybrid.client import PSClient, PSTable, coalesce


@dataclass
class StepClock:
    """The step the worker is on (pulls are tagged with it) and the tensors of its batch
    (``leaves``: path in the inputs structure to tensor), set before each forward."""

    step: int = 0
    leaves: dict = field(default_factory=dict)
    seen: list = field(default_factory=list)  # [(input tensor, ServedEmbedding)] this step
    on_gradients: object = None  # callable(ServedEmbedding): early push from the backward pass
    host: dict = field(default_factory=dict)  # id(batch tensor on the device) -> the same tensor on the host

    def set_batch(self, host_inputs, device_inputs) -> None:
        """The step's batch as read from data() (``host_inputs``) and as moved to the worker's
        device: served lookups read their ids from the host copy, so no id tensor travels
        device -> host (a blocking copy on CUDA) unless the model computed it on the device."""
        self.leaves = batch_leaves(host_inputs)
        dev = batch_leaves(device_inputs)
        self.host = {id(dev[p]): self.leaves[p] for p in dev if p in self.leaves}

    def on_host(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` on the host: the batch's own host tensor when ``ids`` is a batch tensor."""
        return self.host.get(id(ids), ids)


@dataclass
class ServedEmbedding:
    """One embedding module served from the PS: its table and this step's pulled rows."""

    module: torch.nn.Module
    table: PSTable
    records: list = field(default_factory=list)  # [(unique ids, pulled rows leaf)]
    source: str | None = None  # batch path this module's input came from, once seen
    follows: "ServedEmbedding | None" = None  # module whose input this one reused, once seen
    covers: str | None = None  # batch path whose ids the input included on its first step
    checked: bool = False  # whether ``covers`` was looked for
    prefetched: tuple | None = None  # (input tensor, unique ids, inverse, waiter)
    ahead: tuple | None = None  # the same for the next step, requested during this one (PullAhead)
    pushed: bool = False  # this step's gradients were handed over early

    def gradients(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(unique ids (k,), summed row gradients (k, dim))`` of this step, on CPU, or
        None when no lookup of this step reached the loss (waits for the copy to the host)."""
        copy = self.host_gradients()
        return None if copy is None else copy.result()

    def host_gradients(self) -> "HostGradients | None":
        """This step's row gradients on their way to the host (:class:`HostGradients`: on CUDA
        a non-blocking copy into pinned memory, so a backward hook does not wait for it), or
        None when no lookup of this step reached the loss."""
        recs = [(ids, rows.grad) for ids, rows in self.records if rows.grad is not None]
        if not recs:
            return None
        host, event = copy_to_host(torch.cat([g for _, g in recs]))
        return HostGradients(torch.cat([i for i, _ in recs]), host, event, len(recs) > 1)

    def clear(self) -> None:
        """Forget this step's rows; consume a prefetched answer the forward did not use
        (its reply must leave the channel before the next pull)."""
        self.records = []
        self.pushed = False
        if self.prefetched is not None:
            self.prefetched[3]()
            self.prefetched = None


@dataclass
class HostGradients:
    """Row gradients of one served table copied to the host: ``ids`` (host int64, one per
    row, repeated where several lookups hit a row: ``merge``), ``rows`` (host; on CUDA a pinned
    buffer that a non-blocking copy fills until ``event`` completes; ``event`` None on CPU)."""

    ids: torch.Tensor
    rows: torch.Tensor
    event: object = None
    merge: bool = False

    def ready(self) -> bool:
        """Whether :meth:`result` can return without waiting for the device."""
        return self.event is None or self.event.query()

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(unique ids (k,), summed rows (k, dim))`` on the host, after the copy completed."""
        if self.event is not None:
            self.event.synchronize()
        return coalesce(self.ids, self.rows) if self.merge else (self.ids, self.rows)


def _local_padding(padding_idx: int | None, uids: torch.Tensor) -> int | None:
    if padding_idx is None:
        return None
    pos = int(torch.searchsorted(uids, torch.tensor(padding_idx)))
    return pos if pos < uids.numel() and int(uids[pos]) == padding_idx else None


def _pull(served: ServedEmbedding, client: PSClient, clock: StepClock, ids: torch.Tensor, items: list):
    pre, served.prefetched = served.prefetched, None
    host_ids = clock.on_host(ids)
    if pre is not None and pre[0] is host_ids:  # rows requested ahead of this call
        uids, inverse, rows = pre[1], pre[2], pre[3]()
    else:
        if served.source is None and served.follows is None:
            served.source = next((p for p, t in clock.leaves.items() if t is host_ids), None)
            served.follows = next((it for t, it in clock.seen if t is ids and it is not served), None)
        uids, inverse = dedup_checked(served, host_ids)
        if not served.checked and served.source is None and served.follows is None:
            served.covers, served.checked = covering_leaf(uids, clock.leaves, served.table.rows), True
        wait = complete(client, served, uids, pre, clock.step)
        for other in items:  # modules that looked up this same tensor on earlier steps
            if other.follows is served and uids.numel() and in_rows(uids, other.table.rows):
                other.covers = other.covers or served.covers
                if other.prefetched is None or other.prefetched[0] is not host_ids:
                    other.prefetched = (
                        host_ids,
                        uids,
                        inverse,
                        complete(client, other, uids, other.prefetched, clock.step),
                    )
        rows = wait()
    rows = rows.to(ids.device, non_blocking=rows.is_pinned())  # pinned: async copy up
    if not torch.is_grad_enabled():  # evaluate(): nothing to push, nothing to remember
        return uids, inverse.to(ids.device, non_blocking=True), rows
    clock.seen.append((ids, served))
    rows.requires_grad_()
    served.records.append((uids, rows))
    if clock.on_gradients is not None:
        rows.register_post_accumulate_grad_hook(lambda _, item=served: _grad_ready(item, clock))
    return uids, inverse.to(ids.device, non_blocking=True), rows


def _grad_ready(item: ServedEmbedding, clock: StepClock) -> None:
    """Backward hook: hand the module's gradients over once every lookup has one."""
    if not item.pushed and all(rows.grad is not None for _, rows in item.records):
        item.pushed = True
        clock.on_gradients(item)


def attach(model: torch.nn.Module, tables: list[PSTable], client: PSClient, clock: StepClock) -> list[ServedEmbedding]:
    """Serve every ``rows`` table's embedding module of ``model`` from the PS.

    Raises ValueError for options whose result depends on the whole table or batch
    (``max_norm`` renormalises table rows in place; ``scale_grad_by_freq`` counts ids in
    the concatenated batch): place such a parameter on allreduce instead.
    """
    modules = dict(model.named_modules())
    served = []
    for table in tables:
        assert table.kind == "rows"
        mod_name = table.name[: -len(".weight")] if table.name.endswith(".weight") else ""
        module = modules[mod_name]
        if module.max_norm is not None or module.scale_grad_by_freq:
            raise ValueError(
                f"{table.name}: max_norm/scale_grad_by_freq embeddings cannot be served from the "
                "parameter server; drop the option or place the parameter on 'allreduce' in the plan"
            )
        item = ServedEmbedding(module, table)
        if isinstance(module, torch.nn.EmbeddingBag):

            def forward(self, input, offsets=None, per_sample_weights=None, _item=item):
                uids, inverse, rows = _pull(_item, client, clock, input, served)
                return F.embedding_bag(
                    inverse,
                    rows,
                    offsets,
                    None,
                    self.norm_type,
                    False,
                    self.mode,
                    False,
                    per_sample_weights,
                    self.include_last_offset,
                    _local_padding(self.padding_idx, uids),
                )
        else:

            def forward(self, input, _item=item):
                uids, inverse, rows = _pull(_item, client, clock, input, served)
                return F.embedding(
                    inverse, rows, _local_padding(self.padding_idx, uids), None, self.norm_type, False, False
                )

        module.forward = types.MethodType(torch.compiler.disable(forward), module)  # see the module docstring
        module.weight.requires_grad_(False)
        module.weight.data = module.weight.data.new_empty(0, table.dim)
        served.append(item)
    return served


def detach(served: list[ServedEmbedding], weights: dict[str, torch.Tensor] | None = None) -> None:
    """Give the modules back their class's forward and, from ``weights`` (table name to the
    full ``(rows, dim)`` tensor; on worker rank 0 at the end), their full weight."""
    for item in served:
        if "forward" in item.module.__dict__:
            del item.module.forward
        if weights is not None:
            w = weights[item.table.name].reshape(item.table.shape)
            item.module.weight.data = w.to(item.module.weight.device)
        item.module.weight.requires_grad_(True)
        item.clear()
