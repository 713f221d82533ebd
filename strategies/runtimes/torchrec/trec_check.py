"""Before start: is TorchRec installed, built for this torch, and can it run the user's model?

TorchRec rides on FBGEMM's compiled kernels, and a build of FBGEMM serves one torch minor:
FBGEMM 1.X is built against torch 2.(X+5), TorchRec 1.X goes with FBGEMM 1.X (the
``_fbgemm_torch_compat_table`` of ``fbgemm_gpu/__init__.py``; FBGEMM's release notes). A
mismatch fails deep in an import (an undefined torch symbol in a ``.so``). :func:`check_available`
reads the installed versions from the packages' metadata, without importing them (the
launcher answers in a second), and names in one line the versions to install, and
``scripts/install_torchrec.sh`` that installs them in the order that works.
:func:`import_torchrec` is the workers' import, its failure one line too.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util

INSTALL = "scripts/install_torchrec.sh"
FBGEMM = ("fbgemm-gpu-cpu", "fbgemm-gpu")  # the CPU build, the CUDA build: one import package, fbgemm_gpu


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def versions() -> dict[str, str | None]:
    """The installed versions of torch, fbgemm (the CPU or the CUDA build) and torchrec
    (None: not installed)."""
    fbgemm = next((v for v in map(_version, FBGEMM) if v), None)
    return {"torch": _version("torch"), "fbgemm_gpu": fbgemm, "torchrec": _version("torchrec")}


def problem(found: dict[str, str | None]) -> str | None:
    """Why ``found`` (:func:`versions`) cannot run TorchRec, in one line naming the versions
    to install, or None when the three match."""
    torch_v = found["torch"] or "?"
    t_major, t_minor = _minor(torch_v) if found["torch"] else (2, 13)
    want = f"1.{t_minor - 5}" if t_major == 2 and t_minor >= 10 else None
    need = (
        (
            f"fbgemm-gpu-cpu=={want}.* then torchrec=={want}.* with --no-deps ({INSTALL} installs the tested "
            f"torch 2.13.0 + fbgemm-gpu-cpu 1.8.0 + torchrec 1.8.0)"
        )
        if want
        else f"torch 2.13.0 with {INSTALL}"
    )
    if found["torchrec"] is None or found["fbgemm_gpu"] is None or importlib.util.find_spec("torchrec") is None:
        missing = [k for k in ("fbgemm_gpu", "torchrec") if found[k] is None] or ["torchrec"]
        return f"--strategy torchrec needs TorchRec ({' and '.join(missing)} not installed): install {need}"
    fb, tr = found["fbgemm_gpu"], found["torchrec"]
    if want is None or ".".join(map(str, _minor(fb))) != want or _minor(tr) != _minor(fb):
        return (
            f"--strategy torchrec: torchrec {tr} and fbgemm_gpu {fb} do not match torch {torch_v} (FBGEMM 1.X is "
            f"built for torch 2.(X+5), TorchRec 1.X for FBGEMM 1.X): install {need}"
        )
    return None


def check_available() -> None:
    """Raise ValueError (one line, :func:`problem`) unless matching TorchRec, FBGEMM and torch
    are installed; reads metadata only (imports neither)."""
    line = problem(versions())
    if line:
        raise ValueError(line)


def import_torchrec() -> None:
    """Import torchrec in a worker; its failure (a missing module, a library built for another
    torch) becomes a ValueError of one line naming :data:`INSTALL`."""
    try:
        import torchrec  # noqa: F401
        import torchrec.distributed  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(
            f"--strategy torchrec: importing torchrec failed ({first}); reinstall it with {INSTALL}"
        ) from None


def check_model(job, model, lr: float) -> str:
    """Refuse (ValueError, one line) a model or script the torchrec runtime cannot run: no
    embedding table to shard, a table TorchRec cannot hold (trec_tables.table_problem), an
    optimizer it cannot fuse (trec_optim), a ``scheduler()`` (its fused optimizer would not
    follow the schedule). Returns a line to print ("" for none)."""
    from hpar.strategies.runtimes.torchrec.trec_optim import check_optimizer
    from hpar.strategies.runtimes.torchrec.trec_tables import tables_of

    try:
        tables = tables_of(model)
    except ValueError as exc:
        raise ValueError(f"{job.path}: {exc}") from None
    if not tables:
        raise ValueError(
            f"{job.path}: --strategy torchrec: the model has no nn.Embedding/nn.EmbeddingBag table to "
            "shard; use --strategy allreduce"
        )
    if job.scheduler_fn is not None:
        raise ValueError(
            f"{job.path}: --strategy torchrec: scheduler() is not supported (TorchRec's fused table "
            "optimizer would keep the first learning rate); drop it or use another strategy"
        )
    try:
        return check_optimizer(
            job.build_optimizer(model.parameters(), lr), model, [f"{n}.weight" if n else "weight" for n, _ in tables]
        )
    except ValueError as exc:
        raise ValueError(f"{job.path}: {exc}") from None
