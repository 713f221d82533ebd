"""Parameters shared by several modules (weight tying), and which embedding tables are
really row-sparse.

A language model that ties its output projection to its input embedding
(``self.out.weight = self.emb.weight``; Press & Wolf 2017, "Using the output embedding to
improve language models") holds ONE parameter in two modules. ``named_parameters()`` lists it
once (under the first holder's name). Its gradient is the sum of both users' gradients: the
Linear's is dense (every row of the vocabulary gets a logit gradient), so the sum is dense.
Such a table must not get ``sparse=True`` gradients (autograd refuses to mix them), must
not be served row by row from parameter servers (the Linear would see an empty weight), and
the profiler must measure it as dense. Every runtime asks :func:`embedding_tables` which
embedding modules it may treat as row-sparse.
"""

from __future__ import annotations

import torch
from torch import nn

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def holders(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """``id(parameter) -> [(qualified parameter path, owning module)]`` for every parameter,
    each holder listed (a tied parameter has several)."""
    out: dict[int, list[tuple[str, nn.Module]]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            path = f"{mname}.{pname}" if mname else pname
            entry = out.setdefault(id(p), [])
            if all(path != q for q, _ in entry):
                entry.append((path, m))
    return out


def shared_parameters(model: nn.Module) -> dict[str, list[str]]:
    """``{name in named_parameters(): [every path that holds it]}`` for the parameters held
    by more than one module path (tied weights)."""
    by_id = holders(model)
    return {n: [q for q, _ in by_id[id(p)]] for n, p in model.named_parameters() if len(by_id[id(p)]) > 1}


def embedding_tables(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(module name, module)`` of every nn.Embedding / nn.EmbeddingBag whose weight only
    embedding lookups use, i.e. whose gradient is row-sparse. A weight tied to a dense user
    (a Linear, say) is left out: it is a dense parameter. A table shared by two embedding
    modules is listed once (its first module)."""
    by_id = holders(model)
    seen, out = set(), []
    for name, m in model.named_modules():
        if not isinstance(m, EMBEDDINGS) or id(m.weight) in seen:
            continue
        seen.add(id(m.weight))
        if all(isinstance(owner, EMBEDDINGS) for _, owner in by_id[id(m.weight)]):
            out.append((name, m))
    return out


def dense_shared_embeddings(model: nn.Module) -> dict[str, list[str]]:
    """Embedding weights (by ``named_parameters`` name) that a non-embedding module also
    uses, with every path holding them: for messages saying why they stay on AllReduce."""
    sparse = {id(m.weight) for _, m in embedding_tables(model)}
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(m.weight)]: shared_parameters(model).get(names[id(m.weight)], [])
        for _, m in model.named_modules()
        if isinstance(m, EMBEDDINGS) and id(m.weight) not in sparse and id(m.weight) in names
    }


def shared_across_stages(layers, ranges) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
    """``{parameter name: (stages holding it, the parameter)}`` for every parameter of
    ``layers`` (the model's ``(name, module)`` layers) held by two or more of the stages
    ``ranges`` (``[start, end)`` layer ranges). The name is the first under which a layer
    lists it (stages may list it under others: ``lm_head.weight`` for ``transformer.wte.weight``)."""
    held: dict[int, list] = {}
    for k, (a, b) in enumerate(ranges):
        for _, layer in layers[a:b]:
            for name, p in layer.named_parameters():
                entry = held.setdefault(id(p), [name, [], p])
                if k not in entry[1]:
                    entry[1].append(k)
    return {name: (tuple(stages), p) for name, stages, p in held.values() if len(stages) > 1}


def stages_of(layers_held: tuple[int, ...], ranges) -> tuple[int, ...]:
    """The stages (``ranges``: ``[start, end)`` layer ranges) holding the layers ``layers_held``."""
    return tuple(sorted({k for k, (a, b) in enumerate(ranges) for i in layers_held if a <= i < b}))
