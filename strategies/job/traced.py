"""The layers of a model that is not a sequence, cut by torch.distributed.pipelining's tracer.

Most models people bring (a ``transformers`` GPT-2, BERT or Llama, a ResNet, an
``nn.TransformerEncoder`` classifier) have glue between their blocks (position embeddings,
attention masks, rotary tables, a pooling), so the blocks alone do not compose to the model.
torch's own splitter does: ``torch.distributed.pipelining.pipeline(model, mb_args, mb_kwargs,
split_spec)`` traces the forward with ``torch.export`` and cuts the graph at ``SplitPoint``s into
sub-GraphModules that pass each other exactly the tensors they need.

The cut points are the model's **repeated blocks** (the children of an ``nn.ModuleList`` or
``nn.Sequential`` all of one class and holding parameters, outermost only; with a Hugging Face
model the classes in ``_no_split_modules``): the layers are the stem, each block and the tail,
which the profiler times, the planner balances into stages and a pipeline stage runs.
:class:`TracedLayers` runs them, passing a tuple of the graph's live values between layers;
:class:`TracedStage` holds a layer's parameters under the whole model's names, a tied weight
mapped back to its one parameter. Limits: the trace is specialised to one micro-batch's shapes
(checked); data-dependent control flow inside blocks falls back to torch.fx with the blocks kept
whole (strategies/job/block_trace.py), and between blocks needs ``hpar_layers()``. How it works:
docs/pipelines.md, "Tracing a model into stages" and "How it works".
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hpar.strategies.common.measured_memory import PeakMemory, load_lazy_imports
from hpar.strategies.job.block_trace import describe_failure, generation_flags_off, split_at_blocks
from hpar.strategies.job.forward import inner_module, takes_keywords
from hpar.strategies.job.traced_stage import Part, TracedStage


@contextlib.contextmanager
def _quiet():
    """torch.export's graph dumps and warnings while ``pipeline()`` traces (dozens of lines
    before a failure) kept out of the user's output: hpar's one-line refusal says what failed."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def block_names(model: nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks, in container order (module docstring):
    ``["transformer.h.0", ..., "transformer.h.11"]`` for GPT-2. Empty when it has none."""
    declared = set(getattr(model, "_no_split_modules", None) or ())
    containers = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) == 0 or not name:
            continue
        kinds = {type(c) for c in m.children()}
        if len(kinds) != 1 or not any(True for _ in m.parameters()):
            continue
        if declared and next(iter(kinds)).__name__ not in declared:
            continue
        if any(name.startswith(outer + ".") for outer in containers):
            continue  # a container inside another's block: the outer blocks are the cut
        containers.append(name)
    return [f"{c}.{i}" for c in containers for i in range(len(model.get_submodule(c)))]


def why_not_traceable(model: nn.Module) -> str:
    """Why the tracer route cannot cut ``model`` ("" when it has repeated blocks to cut at)."""
    if not block_names(inner_module(model)):
        return "it has no repeated blocks (an nn.ModuleList or nn.Sequential of modules of one class) to cut between"
    return ""


def _split_spec(blocks: list[str], order: list[str]) -> dict:
    """torch's ``split_spec``: a cut before every block and before the first module called
    after the last block (the tail's; none when the model returns the last block's output).
    ``order``: module names in the order their forward started, in one eager call."""
    from torch.distributed.pipelining import SplitPoint

    spec = {b: SplitPoint.BEGINNING for b in blocks}
    last = len(order) - 1 - order[::-1].index(blocks[-1]) if blocks[-1] in order else len(order)
    seen = set(order[: last + 1])
    tail = next((n for n in order[last + 1 :] if n not in seen and not n.startswith(blocks[-1] + ".")), None)
    if tail is not None:
        spec[tail] = SplitPoint.BEGINNING
    return spec


def _unwrap_split_points(model: nn.Module, spec: dict) -> None:
    """Undo what ``pipeline()`` does to the model in place (torch 2.13's
    ``annotate_split_points`` wraps each split module's ``forward`` and keeps the original in
    ``_orig_forward``): the user's model runs as before, and a second trace works."""
    for name in spec:
        sub = model.get_submodule(name)
        orig = sub.__dict__.pop("_orig_forward", None)
        if orig is None:
            continue
        if getattr(orig, "__self__", None) is sub and getattr(orig, "__func__", None) is type(sub).forward:
            sub.__dict__.pop("forward", None)  # the class's forward again
        else:
            sub.__dict__["forward"] = orig


def _read_attributes(gm: nn.Module) -> set[str]:
    """Qualified names (in ``gm``) of the attributes its graphs read with ``get_attr``, and
    the tensors of the leaf modules (no graph of their own: block_trace.py's) they call."""
    used = set()
    for prefix, m in gm.named_modules():
        for node in getattr(getattr(m, "graph", None), "nodes", ()):
            name = f"{prefix}.{node.target}" if prefix else node.target
            if node.op == "get_attr":
                used.add(name)
            elif node.op == "call_module" and not hasattr(m.get_submodule(node.target), "graph"):
                leaf = m.get_submodule(node.target)
                used.update(f"{name}.{n}" for n, _ in leaf.named_parameters(remove_duplicate=False))
                used.update(f"{name}.{n}" for n, _ in leaf.named_buffers(remove_duplicate=False))
    return used


class _Const:
    """A non-tensor leaf of the model's output (kept as traced)."""

    def __init__(self, value):
        self.value = value


class TracedLayers:
    """``model`` traced on ``example`` (one micro-batch of inputs) and cut at its blocks:
    ``layers`` are ``(name, TracedStage)`` pairs whose composition equals ``model(example)``;
    :meth:`stage` joins a range of them. Raises ValueError (why, and ``hpar_layers()`` as the
    way out) when the model has no blocks or torch.export cannot trace it."""

    def __init__(self, model: nn.Module, example):
        model = inner_module(model)
        blocks = block_names(model)
        if not blocks:
            raise ValueError(
                f"the model ({type(model).__name__}) is not a sequence of layers and "
                f"{why_not_traceable(model)}; define hpar_layers()"
            )
        keywords = takes_keywords(model, example)
        args, kwargs = ((), dict(example)) if keywords else ((example,), {})
        training = model.training
        try:
            with generation_flags_off(model), torch.random.fork_rng(devices=[]), torch.no_grad():
                model.train()
                kept = {k: b.clone() for k, b in model.named_buffers()}  # BatchNorm's statistics
                try:
                    top = self._trace(model, args, kwargs, blocks)
                except ValueError:
                    raise
                except Exception as exc:  # the forward itself failed on the micro-batch
                    raise ValueError(
                        f"torch.distributed.pipelining could not trace the model: "
                        f"{describe_failure(exc)}; define hpar_layers()"
                    ) from None
                finally:
                    for k, b in model.named_buffers():  # the eager calls are not a training step
                        b.copy_(kept[k])
        finally:
            model.train(training)
        self.keywords = keywords
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.input_shapes = [tuple(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self._read_graph(top, model)
        self.layers = [(self._name(i, blocks), TracedStage(self, i, i + 1)) for i in range(len(self.parts))]

    def _trace(self, model: nn.Module, args, kwargs, blocks: list[str]):
        """The split top graph: torch's ``pipeline()`` (torch.export), else the forward with its
        blocks kept whole (block_trace.py); ValueError naming both failures and the way out."""
        from torch.distributed.pipelining import pipeline

        order: list[str] = []
        hooks = [
            m.register_forward_pre_hook(lambda mod, a, n=name: order.append(n))
            for name, m in model.named_modules()
            if name
        ]
        try:
            _, self.out_spec = tree_flatten(model(*args, **kwargs))
        finally:
            for h in hooks:
                h.remove()
        spec = _split_spec(blocks, order)
        try:
            with warnings.catch_warnings(), _quiet():  # torch 2.13's own pytree deprecation, inside pipeline()
                warnings.simplefilter("ignore", FutureWarning)
                return pipeline(model, mb_args=args, mb_kwargs=kwargs, split_spec=spec).split_gm
        except Exception as exc:  # torch.export could not capture the forward
            exported = describe_failure(exc)
        finally:
            _unwrap_split_points(model, spec)
        try:
            with warnings.catch_warnings(), _quiet():
                warnings.simplefilter("ignore")
                return split_at_blocks(model, args, kwargs, blocks)
        except Exception as exc:
            kept = f"{blocks[0]} ... {blocks[-1]}" if len(blocks) > 1 else blocks[0]
            raise ValueError(
                f"torch.distributed.pipelining could not trace the model: torch.export stopped at "
                f"{exported}; with its blocks ({kept}) kept whole, torch.fx stopped at "
                f"{describe_failure(exc)}; define hpar_layers()"
            ) from None

    def _read_graph(self, top, model: nn.Module) -> None:
        """Fill ``parts``, ``placeholders``, ``output_keys`` and ``tensors`` from the split."""
        nodes = list(top.graph.nodes)
        calls = [n for n in nodes if n.op == "call_module"]
        index = {n: i for i, n in enumerate(calls)}
        self.placeholders = [n.name for n in nodes if n.op == "placeholder"]
        produced = {n.name: -1 for n in nodes if n.op == "placeholder"}
        for n in nodes:
            if n.op == "call_module":
                produced[n.name] = index[n]
            elif n.op == "call_function" and n.args and n.args[0] in index:
                produced[n.name] = index[n.args[0]]
        out_node = next(n for n in nodes if n.op == "output")
        out_leaves, _ = tree_flatten(out_node.args[0])
        self.output_keys = [x.name if isinstance(x, torch.fx.Node) else _Const(x) for x in out_leaves]
        last_use = {k: -1 for k in produced}
        for call in calls:
            for a in call.args:
                assert isinstance(a, torch.fx.Node), f"a traced stage takes a constant argument {a!r}"
                last_use[a.name] = max(last_use[a.name], index[call])
        for k in self.output_keys:
            if isinstance(k, str):
                last_use[k] = len(calls)
        order = [n.name for n in nodes if n.name in produced]
        whole = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        self.tensors: dict[str, torch.Tensor] = {}
        self.persistent = set(model.state_dict())  # buffers a state_dict holds (not RoPE's inv_freq)
        self.parts = []
        for i, call in enumerate(calls):
            gm = getattr(top, call.target)
            for m in gm.modules():  # torch.fx's Interpreter costs ~1.8x the generated code per
                if hasattr(m, "_run_with_interpreter"):  # op; the code breaks on a child named `self` (BERT's)
                    m._run_with_interpreter = "self" in m._modules
            outputs = [(u.name, u.args[1]) for u in call.users if u.op == "call_function"]
            if any(u.op != "call_function" for u in call.users):
                outputs.append((call.name, None))
            slots, used = [], _read_attributes(gm)
            for kind, named in (
                (True, gm.named_parameters(remove_duplicate=False)),
                (False, gm.named_buffers(remove_duplicate=False)),
            ):
                for fqn, t in named:
                    if fqn not in used:  # e.g. the tracer's copy of a tied weight a sub-graph never reads
                        continue
                    prefix, _, attr = fqn.rpartition(".")
                    self.tensors.setdefault(fqn, whole.get(fqn, buffers.get(fqn, t)) if kind else buffers.get(fqn, t))
                    slots.append((gm.get_submodule(prefix), attr, fqn, kind))
            carry = [k for k in order if produced[k] <= i < last_use[k]]
            self.parts.append(Part(gm, [a.name for a in call.args], outputs, slots, carry))

    def _name(self, i: int, blocks: list[str]) -> str:
        """A layer's name: its block's; else the deepest module (2 levels or more) holding all
        its parameters (``bert.embeddings``), or those modules joined with + (stem, tail)."""
        owners = list(dict.fromkeys(fqn.rpartition(".")[0] or fqn for _, _, fqn, p in self.parts[i].slots if p))
        if not owners:
            return f"part{i}"
        inside = [b for b in blocks if any(o == b or o.startswith(b + ".") for o in owners)]
        if len(inside) == 1:  # a block and the glue after it (T5's encoder.block.1+encoder.final_layer_norm)
            rest = [o for o in owners if not o.startswith(inside[0] + ".") and o != inside[0]]
            return "+".join([inside[0], *rest[:2]]) + ("+..." if len(rest) > 2 else "")
        common = []
        for pieces in zip(*(o.split(".") for o in owners)):
            if len(set(pieces)) > 1:
                break
            common.append(pieces[0])
        if len(common) >= 2:
            return ".".join(common)
        return "+".join(owners[:3]) + ("+..." if len(owners) > 3 else "")

    def bind_inputs(self, value) -> dict:
        """The graph's placeholders from the user's inputs; ValueError on other shapes."""
        args, kwargs = ((), dict(value)) if self.keywords else ((value,), {})
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        shapes = [tuple(t.shape) for t in leaves]
        if shapes != self.input_shapes:
            raise ValueError(
                f"--strategy pipeline: the model was traced for micro-batches of input shapes "
                f"{self.input_shapes}, got {shapes}; a traced pipeline needs every micro-batch in those "
                "shapes (pad sequences to one length, keep the batch size fixed)"
            )
        return dict(zip(self.placeholders, leaves))

    def stage(self, start: int, end: int) -> TracedStage:
        """Layers ``[start, end)`` as one module (a pipeline stage)."""
        assert 0 <= start < end <= len(self.parts), (start, end, len(self.parts))
        return TracedStage(self, start, end)


_CACHE: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def traced_layers(model: nn.Module, example) -> TracedLayers:
    """:class:`TracedLayers` of ``model`` at ``example``'s shapes, traced once per model and
    shapes (a trace takes about a second for a small transformer)."""
    key = tuple((tuple(t.shape), t.dtype) for t in tree_flatten(example)[0] if isinstance(t, torch.Tensor))
    hit = _CACHE.get(model)
    if hit is None or hit[0] != key:
        load_lazy_imports()  # torch._dynamo, in a worker's baseline already: not the trace's
        mem = PeakMemory(torch.device("cpu"))  # host memory: a worker traces its model there
        mem.start()
        _CACHE[model] = hit = (key, TracedLayers(model, example))
        _FIRST_TRACE[:] = _FIRST_TRACE or [mem.peak_bytes() or 0]
    return hit[1]


_FIRST_TRACE: list[int] = []


def first_trace_bytes() -> int:
    """The resident peak (bytes, above its start) of the first successful trace in this process:
    the modules torch.export and the tracers import on first use (code and state, docs/strategies.md,
    "Memory and --worker-memory": they are not in a worker's baseline, which opens before its stage is cut),
    the graphs the trace keeps and its transients; 0 where none ran or it cannot be measured.
    Every pipeline worker of a traced model pays it once (``MemoryProfile.trace_bytes``)."""
    return _FIRST_TRACE[0] if _FIRST_TRACE else 0


__all__ = ["block_names", "why_not_traceable", "TracedLayers", "TracedStage", "traced_layers", "first_trace_bytes"]
