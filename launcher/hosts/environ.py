"""What remote processes inherit from the launcher's environment: a documented allowlist,
plus the variables named with ``--env KEY`` / ``--env KEY=VALUE`` (repeatable), never the whole
environment.

Processes on this machine inherit the launcher's environment as any child does (plus the
``--env`` values); processes started over SSH or ``srun`` get only:

- the names in ``ALLOW_NAMES`` (``PYTHONPATH``, thread counts, locale, ``LD_LIBRARY_PATH``, ...)
- every variable whose name starts with one of ``ALLOW_PREFIXES`` (``NCCL_``, ``GLOO_``,
  ``TORCH``, ``PYTORCH_``, ``TRANSFORMERS_``, ``HPAR_``, ...) unless its name looks like a
  credential (below)
- the ``--env`` variables, which win over the allowlist.

Names that may hold a credential are forwarded only when named with ``--env`` (``--env HF_TOKEN``
forwards the launcher's own value): every name under ``CREDENTIAL_PREFIXES`` (``HF_``,
``HUGGINGFACE_``, ``HUGGING_FACE_``, ``WANDB_``, ``MLFLOW_``: those services keep tokens, API keys,
passwords and URLs with a password in them there) and every name that contains one of
``CREDENTIAL_WORDS`` (``TOKEN``, ``SECRET``, ``KEY``, ``PASSWORD``, ``PASSWD``, ``CREDENTIAL``,
``AUTH``) in any case, such as ``NCCL_IB_PKEY``: a wrong guess costs one ``--env`` flag, a missed
secret costs the secret. The fixed names of ``ALLOW_NAMES`` hold none (``TOKENIZERS_PARALLELISM``).

Login variables (``PATH``, ``HOME``, ``USER``, ``SHELL``), per-host ones
(``CUDA_VISIBLE_DEVICES``, which the host or Slurm sets) and everything else (cloud
credentials, SSH agent sockets, ...) stay behind unless named with ``--env``. The launcher
prints the forwarded *names* (never values) before it starts, and the credential-like ones it
held back. The values travel in memory only: over the SSH channel's stdin
(launcher/procs/ssh.py) or in srun's own environment (launcher/procs/srun.py), never in a
command line or a file.
"""

from __future__ import annotations

import os
import re

ALLOW_NAMES = (
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONWARNINGS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "LD_LIBRARY_PATH",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "TOKENIZERS_PARALLELISM",
    "LANG",
    "LC_ALL",
    "TZ",
)
ALLOW_PREFIXES = ("NCCL_", "GLOO_", "TORCH", "PYTORCH_", "TRANSFORMERS_", "HPAR_", "CUBLAS_", "CUDNN_", "UCX_", "FI_")
# names that may hold a credential: forwarded only when named with --env (see the module docstring)
CREDENTIAL_PREFIXES = ("HF_", "HUGGINGFACE_", "HUGGING_FACE_", "WANDB_", "MLFLOW_")
CREDENTIAL_WORDS = ("TOKEN", "SECRET", "KEY", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
# hpar sets these per process; a launcher's own value must not leak into a remote process
_NEVER = (
    "HPAR_CONFIG",
    "HPAR_PG_RANK",
    "HPAR_PG_WORLD_SIZE",
    "HPAR_SERVER_INDEX",
    "HPAR_NUM_SERVERS",
    "HPAR_THREADS",
    "HPAR_PROCS_ON_HOST",
    "TORCHELASTIC_USE_AGENT_STORE",
    "HPAR_HOLD_STORE",
)
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def credential_like(name: str) -> bool:
    """True when ``name`` may hold a credential: it starts with one of ``CREDENTIAL_PREFIXES`` or
    contains one of ``CREDENTIAL_WORDS``, in any case. Such a variable is forwarded only when
    named with ``--env``."""
    upper = name.upper()
    return upper.startswith(CREDENTIAL_PREFIXES) or any(word in upper for word in CREDENTIAL_WORDS)


def allowed(name: str) -> bool:
    """True when the allowlist forwards the variable ``name`` to remote processes (without
    ``--env``): a fixed name, or an allowlisted prefix and no credential-like name."""
    if name in _NEVER:
        return False
    return name in ALLOW_NAMES or (name.startswith(ALLOW_PREFIXES) and not credential_like(name))


def held_back(extra: "dict[str, str] | None" = None, environ=None) -> list[str]:
    """The credential-like variables of ``environ`` that the allowlist would otherwise forward
    (an allowlisted or credential prefix) and ``--env`` (``extra``) does not name, sorted."""
    environ = os.environ if environ is None else environ
    return sorted(
        k
        for k in environ
        if k not in (extra or {})
        and k not in _NEVER
        and credential_like(k)
        and k not in ALLOW_NAMES
        and k.startswith(ALLOW_PREFIXES + CREDENTIAL_PREFIXES)
    )


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
    """One line naming (never showing) the forwarded variables, the ``--env`` ones marked, and
    after ``; `` the credential-like ones held back (:func:`held_back`)."""
    names = sorted(forwarded(extra, environ))
    if not names:
        line = "environment forwarded to remote processes: none (allowlist empty here; add --env KEY)"
    else:
        shown = ", ".join(f"{n} (--env)" if extra and n in extra else n for n in names)
        line = f"environment forwarded to remote processes: {shown}"
    kept = held_back(extra, environ)
    if kept:
        line += f"; not forwarded, may hold secrets (forward with --env NAME): {', '.join(kept)}"
    return line
