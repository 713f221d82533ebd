"""What remote processes inherit from the launcher's environment: a documented allowlist,
plus the variables named with ``--env KEY`` / ``--env KEY=VALUE`` (repeatable), never the whole
environment.

Processes on this machine inherit the launcher's environment as any child does (plus the
``--env`` values); processes started over SSH or ``srun`` get only:

- the names in ``ALLOW_NAMES`` (``PYTHONPATH``, thread counts, locale, ``LD_LIBRARY_PATH``, ...)
- every variable whose name starts with one of ``ALLOW_PREFIXES`` (``NCCL_``, ``GLOO_``,
  ``TORCH``, ``PYTORCH_``, ``HF_``, ``WANDB_``, ``MLFLOW_``, ``HPAR_``, ...)
- the ``--env`` variables, which win over the allowlist.

Login variables (``PATH``, ``HOME``, ``USER``, ``SHELL``), per-host ones
(``CUDA_VISIBLE_DEVICES``, which the host or Slurm sets) and everything else (cloud
credentials, SSH agent sockets, ...) stay behind unless named with ``--env``. The launcher
prints the forwarded *names* (never values: ``WANDB_API_KEY`` is a secret) before it starts.
"""
from __future__ import annotations

import os
import re

ALLOW_NAMES = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONWARNINGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "OPENBLAS_NUM_THREADS", "LD_LIBRARY_PATH", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS",
               "TOKENIZERS_PARALLELISM", "LANG", "LC_ALL", "TZ")
ALLOW_PREFIXES = ("NCCL_", "GLOO_", "TORCH", "PYTORCH_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "WANDB_",
                  "MLFLOW_", "HPAR_", "CUBLAS_", "CUDNN_", "UCX_", "FI_")
# hpar sets these per process; a launcher's own value must not leak into a remote process
_NEVER = ("HPAR_CONFIG", "HPAR_PG_RANK", "HPAR_PG_WORLD_SIZE", "HPAR_SERVER_INDEX", "HPAR_NUM_SERVERS",
          "HPAR_THREADS", "HPAR_PROCS_ON_HOST", "TORCHELASTIC_USE_AGENT_STORE", "HPAR_HOLD_STORE")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def allowed(name: str) -> bool:
    """True when the allowlist forwards the variable ``name`` to remote processes."""
    return name not in _NEVER and (name in ALLOW_NAMES or name.startswith(ALLOW_PREFIXES))


def allowlisted(environ: "dict[str, str] | os._Environ | None" = None) -> dict[str, str]:
    """The allowlisted part of ``environ`` (default: this process's environment)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if allowed(k)}


def parse_env_flags(values: "tuple[str, ...] | list[str]", environ=None) -> dict[str, str]:
    """The ``--env`` flags as a dict: ``KEY=VALUE`` sets KEY to VALUE, a bare ``KEY`` forwards
    the launcher's own value of KEY. Raises ValueError naming the flag when KEY is not an
    identifier or a bare KEY is not set here."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for value in values:
        key, eq, val = value.partition("=")
        if not _KEY.match(key):
            raise ValueError(f"--env {value!r}: {key!r} is not a variable name; use --env KEY or --env KEY=VALUE")
        if not eq:
            if key not in environ:
                raise ValueError(f"--env {key}: {key} is not set in this environment; use --env {key}=VALUE")
            val = environ[key]
        out[key] = val
    return out


def forwarded(extra: "dict[str, str] | None" = None, environ=None) -> dict[str, str]:
    """Everything a remote process gets from the launcher: the allowlisted variables of
    ``environ`` overridden by ``extra`` (the ``--env`` values)."""
    return {**allowlisted(environ), **(extra or {})}


def describe(extra: "dict[str, str] | None" = None, environ=None) -> str:
    """One line naming (never showing) the forwarded variables, the ``--env`` ones marked."""
    names = sorted(forwarded(extra, environ))
    if not names:
        return "environment forwarded to remote processes: none (allowlist empty here; add --env KEY)"
    shown = ", ".join(f"{n} (--env)" if extra and n in extra else n for n in names)
    return f"environment forwarded to remote processes: {shown}"
