"""Load and check a user's training script (the contract: docs/contract.md).

A script is a plain Python file written for one device. It defines::

    model() -> torch.nn.Module
    data(rank: int, world_size: int, batch_size: int) -> Iterator[(inputs, targets)]
    loss(output, targets) -> scalar Tensor
    optimizer(params) -> torch.optim.Optimizer      # optional, default SGD(lr)
    scheduler(optimizer) -> LRScheduler             # optional, stepped once per optimizer step
    evaluate(model) -> dict[str, float]             # optional
    log(step, output, targets) -> dict[str, float]  # optional, extra per-step metrics
    HPAR = {"batch_size": 32, "steps": 200, "lr": 0.1}  # optional defaults

Every problem is raised as :class:`JobError` (a ``ValueError``) whose message is one line
naming the file and what to fix; the CLI prints it and exits with code 2 before any process
starts.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from hpar.strategies.job.errors import JobError, check_script_file  # noqa: F401 (apart: the CLI names them without torch)
from hpar.strategies.job.forward import call_model
from hpar.strategies.job.user_errors import (
    call_user,
    describe_error,
    user_error,
    user_frame,
    user_traceback_of,
    where_in_script,
)

REQUIRED = ("model", "data", "loss")
OPTIONAL = ("optimizer", "scheduler", "evaluate", "log")
DEFAULT_KEYS = {
    "batch_size": int,
    "steps": int,
    "lr": float,
    "seed": int,
    "log_every": int,
    "micro_batches": int,
    "checkpoint_every": int,
    "keep_checkpoints": int,
    "precision": str,
    "clip_grad_norm": float,
    "accumulate": int,
    "eval_every": int,
    "find_unused_parameters": str,
}
ARITY = {"model": 0, "data": 3, "loss": 2, "optimizer": 1, "scheduler": 1, "evaluate": 1, "log": 3}


@dataclass(frozen=True)
class Job:
    """A loaded user script. ``path`` is absolute; the callables are the user's own."""

    path: str
    model_fn: Callable[[], torch.nn.Module]
    data_fn: Callable[[int, int, int], Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer_fn: Callable[[Any], torch.optim.Optimizer] | None
    evaluate_fn: Callable[[torch.nn.Module], dict] | None
    defaults: dict = field(default_factory=dict)
    scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None
    log_fn: Callable[[int, Any, Any], dict] | None = None
    loaded_rss: int = 0  # resident bytes of this process once the script was imported (a process's fixed overhead)
    cold: dict = field(default_factory=dict)  # what check_job's first data() draw and forward added (bytes)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def build_model(self) -> torch.nn.Module:
        """Call ``model()`` and check it returns an ``nn.Module``. Raises JobError."""
        m = _call(self, "model")
        if not isinstance(m, torch.nn.Module):
            raise JobError(f"{self.path}: model() returned {type(m).__name__}, expected a torch.nn.Module")
        return m

    def batches(self, rank: int, world_size: int, batch_size: int) -> Iterator[tuple[Any, Any]]:
        """Endless iterator over this rank's ``(inputs, targets)`` batches: calls ``data()``
        again when an epoch ends. Raises JobError if data() is not iterable, is empty, or
        yields something other than a pair."""
        for epoch in itertools.count():
            it = _call(self, "data", rank, world_size, batch_size)
            try:
                it = iter(it)
            except TypeError:
                raise JobError(
                    f"{self.path}: data() returned {type(it).__name__}, expected an iterator of (inputs, targets)"
                ) from None
            n = 0
            for item in _user_items(self, it):
                if not (isinstance(item, (tuple, list)) and len(item) == 2):
                    raise JobError(
                        f"{self.path}: data() yielded {type(item).__name__}, expected a pair (inputs, targets)"
                    )
                n += 1
                yield item[0], item[1]
            if n == 0:
                raise JobError(
                    f"{self.path}: data(rank={rank}, world_size={world_size}, batch_size={batch_size}) yielded no batch"
                )

    def compute_loss(self, output: Any, targets: Any) -> torch.Tensor:
        """Call ``loss(output, targets)``; raises JobError unless it is a scalar tensor."""
        value = _call(self, "loss", output, targets)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise JobError(f"{self.path}: loss() returned {type(value).__name__}, expected a scalar torch.Tensor")
        return value

    def build_optimizer(self, params, lr: float) -> torch.optim.Optimizer:
        """The user's ``optimizer(params)`` with every group's lr set to ``lr``, or plain SGD."""
        params = list(params)
        if self.optimizer_fn is None:
            return torch.optim.SGD(params, lr=lr)
        opt = _call(self, "optimizer", params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise JobError(f"{self.path}: optimizer() returned {type(opt).__name__}, expected a torch.optim.Optimizer")
        for group in opt.param_groups:
            group["lr"] = lr
        return opt

    def build_scheduler(self, opt: torch.optim.Optimizer):
        """The user's ``scheduler(optimizer)`` (a ``torch.optim.lr_scheduler.LRScheduler``,
        stepped once per optimizer step), or None when the script has none. Raises JobError."""
        if self.scheduler_fn is None:
            return None
        sched = _call(self, "scheduler", opt)
        if not isinstance(sched, torch.optim.lr_scheduler.LRScheduler):
            raise JobError(
                f"{self.path}: scheduler() returned {type(sched).__name__}, expected a "
                "torch.optim.lr_scheduler.LRScheduler"
            )
        return sched

    def run_log(self, step: int, output: Any, targets: Any) -> dict:
        """``log(step, output, targets)`` as a dict of floats ({} when the script has none);
        ``step`` is 1-based. Raises JobError for another return type."""
        if self.log_fn is None:
            return {}
        with torch.no_grad():
            result = _call(self, "log", step, output, targets)
        return _float_dict(self, "log", result)

    def run_evaluate(self, model: torch.nn.Module) -> dict:
        """``evaluate(model)`` as a dict of floats ({} when the script has none)."""
        if self.evaluate_fn is None:
            return {}
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                result = _call(self, "evaluate", model)
        finally:
            model.train(was_training)
        return _float_dict(self, "evaluate", result)


def _float_dict(job: Job, name: str, result) -> dict:
    """``result`` as {str: float} (0-d tensors accepted); JobError naming ``name()`` otherwise."""
    ok = (int, float, torch.Tensor)
    if (
        not isinstance(result, dict)
        or not all(isinstance(v, ok) and not isinstance(v, bool) for v in result.values())
        or any(isinstance(v, torch.Tensor) and v.numel() != 1 for v in result.values())
    ):
        raise JobError(f"{job.path}: {name}() returned {type(result).__name__}, expected a dict of str to float")
    return {str(k): float(v) for k, v in result.items()}


def _user_items(job: Job, it):
    """Items of the user's ``data()`` iterator; an exception raised while producing one (the
    generator's body runs only now) is a JobError naming the file, line and function of the
    user's code where it was raised, with the user's traceback."""
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except JobError:
            raise
        except Exception as exc:
            frame = user_frame(job, exc.__traceback__)
            inside = "" if frame is None or frame.name == "data" else " in data()"
            raise JobError(
                f"{where_in_script(job, frame, 'data()')} raised {type(exc).__name__} while producing a batch{inside}: "
                f"{describe_error(exc).split(': ', 1)[-1]}",
                user_traceback=user_traceback_of(job, exc),
            ) from exc
        yield item


def _call(job: Job, name: str, *args):
    fn = {
        "model": job.model_fn,
        "data": job.data_fn,
        "loss": job.loss_fn,
        "optimizer": job.optimizer_fn,
        "scheduler": job.scheduler_fn,
        "evaluate": job.evaluate_fn,
        "log": job.log_fn,
    }[name]
    try:
        return fn(*args)
    except JobError:
        raise
    except Exception as exc:  # the user's own code failed: name where, keep their traceback
        raise user_error(job, exc, f"{name}()") from exc


def load_job(path: str) -> Job:
    """Import the script at ``path`` and check the contract (functions present, callable,
    with the right arity; HPAR a dict of known keys). Does not call the user's functions.

    Raises JobError (one line naming the file) for: a missing file, a syntax error (with the
    line), an exception while importing, a missing or non-callable function, a wrong
    signature, or bad HPAR defaults.
    """
    path = check_script_file(path)
    module_name = "hpar_user_" + "".join(c if c.isalnum() else "_" for c in os.path.basename(path)[:-3])
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets pickling and dataclasses in the script work
    script_dir = os.path.dirname(path)
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:  # sys.exit() at import: nothing would run, say so
        raise JobError(
            f"{path}: the script called sys.exit({exc.code!r}) while being imported; guard the "
            'code that runs it with `if __name__ == "__main__":`',
            user_traceback=traceback.format_exc(),
        ) from None
    except Exception as exc:
        raise JobError(
            f"{path}: importing the script raised {describe_error(exc)}", user_traceback=traceback.format_exc()
        ) from exc
    fns = {}
    arity = ARITY
    for name in REQUIRED + OPTIONAL:
        fn = getattr(module, name, None)
        if fn is None:
            if name in REQUIRED:
                raise JobError(
                    f"{path}: missing function {name}(); the contract needs model(), data(rank, world_size, batch_size) and loss(output, targets)"
                )
            fns[name] = None
            continue
        if not callable(fn):
            raise JobError(f"{path}: {name} is a {type(fn).__name__}, expected a function")
        try:
            inspect.signature(fn).bind(*range(arity[name]))
        except TypeError:
            raise JobError(f"{path}: {name}() must take {arity[name]} positional argument(s)") from None
        except ValueError:
            pass  # builtins without a signature
        fns[name] = fn
    defaults = getattr(module, "HPAR", {})
    if not isinstance(defaults, dict):
        raise JobError(f"{path}: HPAR is a {type(defaults).__name__}, expected a dict of defaults")
    for key, value in defaults.items():
        if key not in DEFAULT_KEYS:
            raise JobError(f"{path}: HPAR has unknown key {key!r}; known keys: {', '.join(DEFAULT_KEYS)}")
        want = DEFAULT_KEYS[key]
        if want is str:
            if not isinstance(value, str):
                raise JobError(f"{path}: HPAR[{key!r}] is {value!r}, expected a string")
        elif (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or (want is int and not isinstance(value, int))
        ):
            raise JobError(f"{path}: HPAR[{key!r}] is {value!r}, expected {DEFAULT_KEYS[key].__name__}")
    return Job(
        path=path,
        model_fn=fns["model"],
        data_fn=fns["data"],
        loss_fn=fns["loss"],
        optimizer_fn=fns["optimizer"],
        evaluate_fn=fns["evaluate"],
        defaults=dict(defaults),
        scheduler_fn=fns["scheduler"],
        log_fn=fns["log"],
        loaded_rss=_resident_bytes(),
    )


def _resident_bytes() -> int:
    """This process's resident set in bytes once torch's lazy imports are in (as in a worker's
    memory baseline, strategies/common/measured_memory.py; 0 where /proc is missing)."""
    from hpar.strategies.common.measured_memory import load_lazy_imports, status_bytes

    load_lazy_imports()
    return status_bytes("VmRSS") or 0


def check_job(job: Job, batch_size: int) -> torch.nn.Module:
    """Dry run of the contract in this process: build the model, draw one batch, run the
    forward pass and the loss, build the optimizer. Returns the model built (seed 0).
    Raises JobError on the first problem; the launcher calls it before starting any process.

    Being the first run of the user's code in this process, it also records in ``job.cold``
    the resident bytes its ``model()`` held besides the parameters, and its first ``data()``
    draw and its first forward added (``model_bytes``, ``data_bytes``, ``forward_bytes``: a
    corpus ``model()`` loads for its vocabulary, the modules ``data()`` imports, a dataset it
    loads, the first use of each kernel), what every worker process pays once inside its training (the memory model's
    measured first-use terms, strategies/profile/memory_profile.py)."""
    from hpar.strategies.common.measured_memory import PeakMemory

    torch.manual_seed(0)
    mem = PeakMemory(torch.device("cpu"))
    mem.start()
    model = job.build_model()
    built = mem.peak_bytes()
    norms = [n or "the model" for n, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if batch_size < 2 and norms:  # torch: "Expected more than 1 value per channel when training"
        raise JobError(
            f"--batch-size {batch_size}: BatchNorm layer {norms[0]!r} of {job.path} needs at least 2 samples "
            "per batch in training; use --batch-size 2 or more"
        )
    mem.start()
    inputs, targets = next(job.batches(0, 1, batch_size))
    data = mem.peak_bytes()
    mem.start()
    output = call_user(job, "the model's forward", call_model, model, inputs)
    job.compute_loss(output, targets)
    if data is not None:
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        job.cold.update(
            model_bytes=max(0, built - params), data_bytes=data, forward_bytes=mem.peak_bytes(), batch_size=batch_size
        )
    job.build_scheduler(job.build_optimizer(model.parameters(), lr=0.01))
    return model
