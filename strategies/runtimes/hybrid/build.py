"""Where a hybrid/ps worker's model comes from, so that a served table is never materialised
on a worker (issue 13, item 8): neither on its device nor in its host memory.

Design. Parameter servers exist for tables larger than a worker's memory, so a worker must
not build the table even once. The user's ``model()`` builds every table in full, though.
Hence:

* a **worker** builds the model on PyTorch's ``meta`` device (``with torch.device("meta")``:
  shapes and dtypes, no storage, no initialisation) from a throwaway import of the script,
  so that tensors ``model()`` leaves in the script's module (a cached corpus that ``data()``
  reads) are not meta in the import the run uses (the throwaway import itself runs outside
  ``meta``, so the module's own tensor constants, which the forward may read, are real),
  empties the served tables
  (``embedding.attach``), gives the rest real, uninitialised storage on its device with
  ``Module.to_empty`` (ties kept: :func:`to_empty_keeping_ties`) and receives the initial
  values of every parameter and buffer that the servers do not hold (the *dense state*),
  and the CPU random generator's state after ``model()``, from server 0;
* **server 0** (a host process that builds the whole model on the CPU with the run's seed
  anyway, to cut its shards) broadcasts that dense state over the default gloo group
  (one flat CPU tensor per dtype, :func:`broadcast_dense`).

So the initial weights equal those of one process calling ``torch.manual_seed(seed)`` then
``model()``, as before (the exactness tests compare hybrid with allreduce and with one
process). A model that cannot be built on ``meta`` (its constructor reads tensor values, or
keeps a plain tensor attribute that is neither a parameter nor a buffer, which ``to_empty``
would leave on ``meta``) is built on the CPU instead, as before this module, and still
receives the dense state, so every process takes part in the same collectives.

``peak_rss_bytes`` is how a test (and ``summary.json``'s ``worker_peak_rss_bytes``) checks it.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


def build_model(job, seed: int, meta: bool = True) -> tuple[torch.nn.Module, bool]:
    """``(model, on_meta)``: the user's ``model()`` after ``torch.manual_seed(seed)``, on the
    ``meta`` device when ``meta`` and the model allows it (see the module docstring), else on
    the CPU. JobError from the user's code is raised from the CPU build, as theirs."""
    torch.manual_seed(seed)
    if meta:
        from hpar.strategies.job.contract import load_job

        try:  # a throwaway import of the script: what model() caches in its module (a corpus) would be meta
            throwaway = load_job(job.path)  # imported as usual: its module's constants stay real tensors
            with torch.device("meta"), _NoInitOnMeta():
                model = throwaway.build_model()
        except Exception:  # a constructor that needs real values: the CPU build says what is wrong, if anything
            model = None
        if model is not None and not _stray_meta_tensors(model):
            return model, True
        torch.manual_seed(seed)
    return job.build_model(), False


def to_empty_keeping_ties(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to_empty(device=device)`` that keeps tied parameters tied: ``to_empty`` gives
    every holder of a shared ``meta`` parameter its own new tensor, so each tie (found with
    ``strategies/tying.holders`` before the move) is restored to the first holder's."""
    from hpar.strategies.job.tying import holders

    ties = [hs for hs in holders(model).values() if len(hs) > 1]
    model.to_empty(device=device)
    for (path, module), *others in ties:
        shared = getattr(module, path.rsplit(".", 1)[-1])
        for other_path, other in others:
            setattr(other, other_path.rsplit(".", 1)[-1], shared)


class _NoInitOnMeta(TorchFunctionMode):
    """Initialisers (``torch.nn.init.*_``, in-place random fills) on a ``meta`` tensor return
    it untouched: its values do not exist, and ``normal_`` on ``meta`` (nn.Embedding's init)
    would import torch's Python decompositions, seconds per process (BENCHMARKS.md, "Launch and
    teardown at scale"), for nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by keyword
        if (
            name.endswith("_")
            and isinstance(target, torch.Tensor)
            and target.is_meta
            and (getattr(func, "__module__", "") == "torch.nn.init" or name in _RANDOM_FILLS)
        ):
            return target
        return func(*args, **kwargs)


_RANDOM_FILLS = {"normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_"}


def _stray_meta_tensors(model: torch.nn.Module) -> bool:
    """Whether a module keeps a tensor attribute that is neither a parameter nor a buffer
    (``to_empty`` and :func:`broadcast_dense` would not give it values)."""
    return any(isinstance(v, torch.Tensor) and v.is_meta for m in model.modules() for v in vars(m).values())


def dense_state(model: torch.nn.Module, ps_names: set[str]) -> list[torch.Tensor]:
    """Every parameter not held by the servers, then every buffer (non-persistent ones too),
    in ``named_parameters`` / ``named_buffers`` order: the same list on every process."""
    params = [p for n, p in model.named_parameters() if n not in ps_names]
    return [t.data for t in params] + [b for _, b in model.named_buffers()]


def broadcast_dense(model: torch.nn.Module, ps_names: set[str], src: int) -> int:
    """Collective over the default (gloo) group, called by every worker and server in the same
    order: default-group rank ``src`` (server 0) sends the values of :func:`dense_state`, every
    other process copies them into its own tensors (on any device). One flat CPU tensor per
    dtype travels. Returns the bytes broadcast."""
    tensors = dense_state(model, ps_names)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    sent = 0
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        numel = sum(t.numel() for t in group)
        if dist.get_rank() == src:
            flat = torch.cat([t.detach().reshape(-1).cpu() for t in group]) if numel else torch.empty(0, dtype=dtype)
        else:
            flat = torch.empty(numel, dtype=dtype)
        dist.broadcast(flat, src)
        sent += flat.numel() * flat.element_size()
        if dist.get_rank() != src:
            at = 0
            with torch.no_grad():
                for t in group:
                    t.copy_(flat[at : at + t.numel()].view(t.shape))
                    at += t.numel()
    # the CPU generator as a process that ran model()'s initialisers leaves it (a meta build
    # skips them), so that dropout and the like draw what they draw under allreduce
    rng = torch.get_rng_state()
    dist.broadcast(rng, src)
    if dist.get_rank() != src:
        torch.set_rng_state(rng)
    return sent + rng.numel()


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes (``getrusage``: kilobytes on
    Linux, bytes on macOS); 0 where the platform has no ``resource`` module."""
    try:
        import resource
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
