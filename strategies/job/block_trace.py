"""What strategies/job/traced.py needs around torch's tracer: generation flags switched off
in every config of a model, a second way to cut a model whose blocks cannot be traced (its
blocks kept whole), and the one-line reason when neither works.

**Generation flags.** A ``transformers`` model keeps ``use_cache`` (the KV cache of
generation) in its config, and an encoder-decoder keeps more than one config: T5 copies its
config for the decoder stack (``T5Stack.config``), so switching the top-level flag off leaves
the decoder building an ``EncoderDecoderCache`` that torch.export cannot trace.
:func:`generation_flags_off` switches every such flag off in every config a module of the
model holds and in their sub-configs (``text_config``, ``encoder``, ``decoder``), for the
trace only; training never reads a cache.

**Blocks kept whole.** A block whose inside depends on the data (a mixture of experts routing
each token to one expert, running an expert only when some token picked it) stops
torch.export. The glue between blocks usually does not. :func:`split_at_blocks` traces the
forward with ``torch.fx``'s symbolic tracer, each repeated block a leaf (one opaque
``call_module``, run eagerly on its stage, so its data-dependent inside runs as on one
process), and cuts the graph with ``torch.fx.passes.split_module`` as torch's
``pipeline()`` cuts an exported one: before every block, and before the first module called
after the last block. The result has the same shape as ``pipeline()``'s ``split_gm`` (a top
graph calling ``submod_i`` GraphModules), so traced.py reads either the same way. Sizes the
forward reads from shapes (``B, T = ids.shape``) are folded into constants, as torch.export
specialises them (every micro-batch has the traced shapes, checked at run time); a value
other than a tensor that would still cross a stage boundary is refused. A parameter read by
two pieces (a tied weight) is read by each (``get_attr`` repeated), so both stages hold it,
as with ``pipeline()``. A leaf module in a piece is a shallow copy of the model's (its own
parameter and sub-module dicts over the same tensors), so pointing a piece at stashed or
predicted weights (traced_stage.py) never touches the model's modules.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import os

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

GENERATION_FLAGS = ("use_cache",)  # generation-time switches a training forward must not follow


def _configs(model: nn.Module) -> list:
    """Every config object the model's modules hold, and their sub-configs, each once."""
    seen: dict[int, object] = {}
    todo = [getattr(m, "config", None) for m in model.modules()]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen or not hasattr(c, "to_dict"):
            continue
        seen[id(c)] = c
        todo.extend(v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "__dict__"))
    return list(seen.values())


@contextlib.contextmanager
def generation_flags_off(model: nn.Module):
    """Every :data:`GENERATION_FLAGS` flag that is on in any config of ``model`` (module
    docstring) set to False inside the block, and back afterwards."""
    changed = [(c, f) for c in _configs(model) for f in GENERATION_FLAGS if getattr(c, f, None)]
    for c, f in changed:
        setattr(c, f, False)
    try:
        yield
    finally:
        for c, f in changed:
            setattr(c, f, True)


def where_raised(exc: BaseException) -> str:
    """``file.py:LINE`` of the deepest frame of ``exc``'s traceback outside torch and hpar (the
    user's line, or the ``transformers`` line, that stopped a trace); "" when none."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found, tb = "", exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not name.startswith(skip) and not name.startswith("<"):
            found = f"{os.path.basename(name)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


def describe_failure(exc: BaseException) -> str:
    """The innermost cause of a failed trace in one whole sentence or line (never cut inside
    one), with where it was raised: ``Could not guard on data-dependent expression ... (at
    moe.py:26)``."""
    inner = exc
    while inner.__cause__ is not None or inner.__context__ is not None:
        inner = inner.__cause__ or inner.__context__
    text = (str(inner).strip().splitlines() or [type(inner).__name__])[0].strip()
    if len(text) > 240 and ". " in text:
        text = text.split(". ")[0] + "."
    where = where_raised(inner) or where_raised(exc)
    return f"{type(inner).__name__}: {text}" + (f" (at {where})" if where else "")


class _Flat(nn.Module):
    """The model's forward on a flat list of input tensors (the example's other leaves kept as
    constants), registered over the model's own children and tensors so that the tracer's
    qualified names are the model's."""

    def __init__(self, model: nn.Module, args, kwargs):
        super().__init__()
        self._modules.update(model._modules)
        self._parameters.update(model._parameters)
        self._buffers.update(model._buffers)
        object.__setattr__(self, "inner", model)  # not a submodule: its names would gain a prefix
        leaves, self.spec = tree_flatten((args, kwargs))
        self.leaves = [None if isinstance(t, torch.Tensor) else t for t in leaves]

    def forward(self, inputs):
        it = iter(inputs)
        args, kwargs = tree_unflatten([next(it) if c is None else c for c in self.leaves], self.spec)
        return self.inner.forward(*args, **kwargs)


class _BlockTracer(fx.Tracer):
    def __init__(self, blocks: set[str]):
        super().__init__()
        self.blocks = blocks

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return qualified_name in self.blocks or super().is_leaf_module(m, qualified_name)


def _values(gm: fx.GraphModule, inputs: list) -> dict:
    """Every node's value on ``inputs`` (one eager run of the graph)."""
    seen: dict = {}

    class Record(fx.Interpreter):
        def run_node(self, n):
            seen[n] = out = super().run_node(n)
            return out

    with torch.no_grad():
        Record(gm).run(inputs)
    return seen


def _foldable(v) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_foldable(x) for x in v)
    return isinstance(v, (int, float, bool)) and not isinstance(v, torch.Tensor)


def _fold_sizes(graph: fx.Graph, values: dict) -> None:
    """Sizes and other Python numbers computed from shapes replaced by their values (module
    docstring)."""
    for node in list(graph.nodes):
        if node.op in ("call_function", "call_method") and _foldable(values.get(node, object())):
            value = tuple(values[node]) if isinstance(values[node], (tuple, list)) else values[node]
            for user in list(node.users):
                user.args = fx.node.map_arg(user.args, lambda a: value if a is node else a)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)
    for node in reversed(list(graph.nodes)):
        if node.op in ("call_function", "call_method") and not node.users and _foldable(values.get(node, object())):
            graph.erase_node(node)


def _pieces(graph: fx.Graph, blocks: set[str]) -> dict:
    """Node -> piece index: a new piece at every block's call and at the first module or
    attribute read after the last block (module docstring)."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    calls = [i for i, n in enumerate(nodes) if n.op == "call_module" and n.target in blocks]
    piece, tail, out = 0, False, {}
    for i, n in enumerate(nodes):
        if i in calls:
            piece += 1
        elif calls and i > calls[-1] and not tail and n.op in ("call_module", "get_attr"):
            piece, tail = piece + 1, True
        out[n] = piece
    return out


def _repeat_attribute_reads(graph: fx.Graph, piece: dict) -> None:
    """A ``get_attr`` read by later pieces repeated in each (a tied weight on both stages)."""
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        for user in list(node.users):
            if user in piece and piece[user] != piece[node]:
                with graph.inserting_before(user):
                    again = graph.get_attr(node.target)
                piece[again] = piece[user]
                user.replace_input_with(node, again)


def _own_containers(m: nn.Module) -> nn.Module:
    """A shallow copy of ``m`` with its own parameter, buffer and sub-module dicts (module
    docstring), and no hooks (as a traced graph calls none)."""
    c = copy.copy(m)
    c._parameters, c._buffers = type(m._parameters)(m._parameters), type(m._buffers)(m._buffers)
    for name, value in vars(m).items():  # hooks put on the model's module are not the copy's
        if "_hooks" in name and isinstance(value, dict):
            setattr(c, name, type(value)())
    c._modules = type(m._modules)((k, _own_containers(v) if v is not None else None) for k, v in m._modules.items())
    return c


def _cut(gm: fx.GraphModule, piece: dict) -> fx.GraphModule:
    """A top GraphModule calling one GraphModule per piece (``submod_i``, the model's qualified
    names kept), passing each the values it reads from before it, as ``pipeline()``'s
    ``split_gm`` does."""
    graph = gm.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    pieces = sorted(set(piece.values()))
    needs: dict = {k: [] for k in pieces}
    gives: dict = {k: [] for k in pieces}
    for node in list(piece) + [out_node]:
        for a in node.all_input_nodes:
            if node is out_node or a not in piece or piece[a] != piece[node]:
                if node is not out_node and a not in needs[piece[node]]:
                    needs[piece[node]].append(a)
                if a in piece and a not in gives[piece[a]]:
                    gives[piece[a]].append(a)
    top, env, subs = fx.Graph(), {}, {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = top.placeholder(node.name)
    for i, k in enumerate(pieces):
        g, local = fx.Graph(), {}
        for a in needs[k]:
            local[a] = g.placeholder(a.name)
        for node in graph.nodes:
            if piece.get(node) == k:
                local[node] = g.node_copy(node, lambda n: local[n])
        outs = [local[a] for a in gives[k]]
        g.output(outs[0] if len(outs) == 1 else tuple(outs))
        subs[f"submod_{i}"] = sub = fx.GraphModule(gm, g)
        for node in sub.graph.nodes:  # the pieces' leaf modules: shallow copies (module docstring)
            if node.op == "call_module":
                owner, _, leaf = node.target.rpartition(".")
                parent = sub.get_submodule(owner) if owner else sub
                setattr(parent, leaf, _own_containers(getattr(parent, leaf)))
        call = top.call_module(f"submod_{i}", tuple(env[a] for a in needs[k]))
        for j, a in enumerate(gives[k]):
            env[a] = call if len(outs) == 1 else top.call_function(operator.getitem, (call, j))
    top.output(fx.node.map_arg(out_node.args[0], lambda n: env[n]))
    return fx.GraphModule(subs, top)


def split_at_blocks(model: nn.Module, args, kwargs, blocks: list[str]) -> fx.GraphModule:
    """``model``'s forward on ``(args, kwargs)`` traced with ``blocks`` (qualified names) kept
    whole and cut before each (module docstring): a top GraphModule calling ``submod_i`` pieces,
    its placeholders the example's tensor leaves in ``tree_flatten((args, kwargs))`` order.
    Raises ValueError (one line) when the glue between the blocks would pass a stage something
    other than a tensor; torch.fx's own exceptions when it cannot be traced."""
    root = _Flat(model, args, kwargs)
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    names = set(blocks)
    graph = _BlockTracer(names).trace(root, concrete_args={"inputs": [fx.PH] * len(inputs)})
    gm = fx.GraphModule(root, graph)
    values = _values(gm, inputs)
    _fold_sizes(gm.graph, values)
    piece = _pieces(gm.graph, names)
    _repeat_attribute_reads(gm.graph, piece)
    for node in [n for n in piece if n.op == "get_attr" and not n.users]:
        gm.graph.erase_node(node)
        del piece[node]
    for node, k in piece.items():
        later = [u for u in node.users if u in piece and piece[u] > k]
        if later and not isinstance(values.get(node), torch.Tensor):
            raise ValueError(
                f"its forward passes {node.name} ({type(values.get(node)).__name__}, not a tensor) "
                "from one piece to a later one around its blocks"
            )
    return _cut(gm, piece)


__all__ = ["generation_flags_off", "describe_failure", "where_raised", "split_at_blocks", "GENERATION_FLAGS"]
