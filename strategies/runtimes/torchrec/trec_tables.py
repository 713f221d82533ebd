"""The user's embedding tables as one-table TorchRec modules, the model's forward unchanged.

:func:`swap_tables` replaces every row-sparse nn.Embedding / nn.EmbeddingBag of the model (the
tables hybrid serves: ``tying.embedding_tables``) by a :class:`TorchrecTable` on its parent
module. A TorchrecTable holds a one-table ``EmbeddingBagCollection`` and takes the inputs the
replaced module took: an nn.EmbeddingBag's ``(input, offsets, per_sample_weights)``, an
nn.Embedding's ids of any shape. It turns them into a ``KeyedJaggedTensor`` of one key (the
bag lengths from the offsets, or from a 2-D input's rows; ``per_sample_weights`` as the KJT's
weights), runs the collection, and gives back what the replaced module would: the pooled
``(bags, dim)`` rows of a bag, or ``ids.shape + (dim,)`` looked-up rows of an nn.Embedding,
looked up as SUM-pooled bags of one id each (the same arithmetic: one row times 1). Sharded by
DistributedModelParallel (trec_shard.py), the collection exchanges the ids and the pooled rows
by all-to-all (TorchRec's table-, row- and column-wise shardings).

What TorchRec's kernels cannot reproduce is refused by :func:`table_problem`, one line each:
``max_norm`` and ``scale_grad_by_freq`` (they depend on the whole table or batch),
``padding_idx`` (TorchRec has no padding row), mode ``"max"`` (TorchRec pools by SUM or MEAN),
a width that is not a multiple of 4 columns (FBGEMM's kernels assert it: a per-word bias table
of one column) and a table another module also holds (the swap would untie it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hpar.strategies.job.tying import embedding_tables, holders
from hpar.strategies.specs.torchrec_spec import COLUMN_MULTIPLE


@dataclass(frozen=True)
class SwappedTable:
    """One swapped table: ``module`` the path of the replaced module in the user's model,
    ``key`` the TorchRec table and feature name (the path with ``.`` as ``__``), ``rows`` x
    ``dim`` its shape, ``bag`` whether it replaced an nn.EmbeddingBag."""

    module: str
    key: str
    rows: int
    dim: int
    bag: bool

    @property
    def weight(self) -> str:
        """The replaced table's parameter name in the user's model (``module.weight``)."""
        return f"{self.module}.weight" if self.module else "weight"


def table_problem(name: str, module: nn.Module, shared: bool) -> str | None:
    """Why ``module`` (the embedding at path ``name``) cannot become a TorchRec table, in one
    line naming the option and the way out, or None when it can. ``shared``: another module
    holds the same weight (tied tables)."""
    where = f"--strategy torchrec: {name or 'the model'}"
    if shared:
        return f"{where} shares its weight with another module (tied tables); TorchRec shards one table per module"
    if module.max_norm is not None or module.scale_grad_by_freq:
        return f"{where} uses max_norm/scale_grad_by_freq, which TorchRec's kernels lack; drop the option"
    if module.padding_idx is not None:
        return f"{where} has padding_idx={module.padding_idx}, which TorchRec's tables lack; drop it"
    if isinstance(module, nn.EmbeddingBag) and module.mode not in ("sum", "mean"):
        return f"{where} pools with mode={module.mode!r}; TorchRec pools by sum or mean"
    if module.embedding_dim % COLUMN_MULTIPLE:
        return (
            f"{where} is {module.embedding_dim} columns wide; FBGEMM's table kernels need a multiple of "
            f"{COLUMN_MULTIPLE}: widen it or use another strategy"
        )
    return None


def tables_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of the tables :func:`swap_tables` would swap: the trainable ones (a
    frozen table stays the user's module, which DDP leaves alone). Raises ValueError (one line,
    :func:`table_problem`) for one it cannot."""
    by_id = holders(model)
    found = [(n, m) for n, m in embedding_tables(model) if m.weight.requires_grad]  # a frozen table stays as it is
    for name, module in found:
        line = table_problem(name, module, len(by_id[id(module.weight)]) > 1)
        if line:
            raise ValueError(line)
    return found


class TorchrecTable(nn.Module):
    """A one-table EmbeddingBagCollection called as the nn.Embedding / nn.EmbeddingBag it
    replaces (module docstring). ``collection`` is built on ``device`` (``meta``: no memory;
    DistributedModelParallel allocates the shards and trec_shard.load_tables fills them)."""

    def __init__(self, table: SwappedTable, mode: str, include_last_offset: bool, device: torch.device):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        self.table, self.include_last_offset = table, include_last_offset
        self.weighted = table.bag and mode == "sum"
        config = EmbeddingBagConfig(
            name=table.key,
            embedding_dim=table.dim,
            num_embeddings=table.rows,
            feature_names=[table.key],
            pooling=PoolingType.MEAN if mode == "mean" else PoolingType.SUM,
        )
        self.collection = EmbeddingBagCollection(tables=[config], is_weighted=self.weighted, device=device)
        self.traffic = [0, 0]  # ids and bags looked up since the runtime last read them (trec_runtime)

    def lengths(self, ids: torch.Tensor, offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids as one flat tensor, bag lengths)``: a 2-D input's rows are bags of equal
        length; a 1-D one is cut at ``offsets`` (the last offset ends the input unless
        ``include_last_offset``); an nn.Embedding's ids are bags of one."""
        if not self.table.bag:
            return ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.int64, device=ids.device)
        if ids.dim() == 2:
            return ids.reshape(-1), torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int64, device=ids.device)
        if offsets is None:
            raise ValueError(f"{self.table.module}: a 1-D input to nn.EmbeddingBag needs offsets")
        ends = (
            offsets[1:]
            if self.include_last_offset
            else torch.cat([offsets[1:], torch.tensor([ids.numel()], dtype=offsets.dtype, device=offsets.device)])
        )
        starts = offsets[:-1] if self.include_last_offset else offsets
        return ids, (ends - starts).to(torch.int64)

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        values, lengths = self.lengths(input, offsets)
        weights = None
        if self.weighted:
            weights = (
                per_sample_weights.reshape(-1)
                if per_sample_weights is not None
                else torch.ones(values.numel(), dtype=torch.float32, device=values.device)
            )
        elif per_sample_weights is not None:
            raise ValueError(f"{self.table.module}: per_sample_weights need mode='sum' (as nn.EmbeddingBag says)")
        self.traffic[0] += values.numel()
        self.traffic[1] += lengths.numel()
        features = KeyedJaggedTensor(
            keys=[self.table.key], values=values.to(torch.int64), lengths=lengths, weights=weights
        )
        pooled = self.collection(features)[self.table.key]
        return pooled if self.table.bag else pooled.reshape(*input.shape, self.table.dim)


def swap_tables(model: nn.Module, device: torch.device = torch.device("meta")) -> list[SwappedTable]:
    """Replace every table of :func:`tables_of` in ``model`` (in place) by a
    :class:`TorchrecTable` built on ``device``; returns what was swapped, in model order.
    Raises ValueError (one line) for a table TorchRec cannot hold."""
    swapped = []
    for name, module in tables_of(model):
        if not name:
            raise ValueError("--strategy torchrec: the model is one embedding table; wrap it in a module")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        bag = isinstance(module, nn.EmbeddingBag)
        table = SwappedTable(name, name.replace(".", "__") or "table", module.num_embeddings, module.embedding_dim, bag)
        setattr(
            parent,
            attr,
            TorchrecTable(table, module.mode if bag else "sum", bag and module.include_last_offset, device),
        )
        swapped.append(table)
    return swapped
