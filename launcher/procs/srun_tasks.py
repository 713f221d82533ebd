"""What a Slurm step's tasks are given (launcher/procs/srun.py): the srun command line, BOOT
(the few lines each task runs to start hpar's guard in a session of its own), ``TASKS.json``'s
entries (written 0600, without any ``--env`` value) and srun's own environment, which carries
the ``--env`` values and the forwarded allowlist in memory."""

from __future__ import annotations

import os
import shutil

from hpar.launcher.hosts.environ import forwarded
from hpar.launcher.procs.local import ProcessSpec
from hpar.strategies.state.checkpoint import atomic_write_bytes

HEARTBEAT_S = 4.0
# Runs in every task: python -c BOOT TASKS.json
BOOT = r"""
import json, os, signal, sys
task = json.load(open(sys.argv[1]))[int(os.environ["SLURM_PROCID"])]
os.environ.update(task["env"])
os.chdir(task["cwd"])
if os.environ["SLURM_PROCID"] == "0":
    print('@hpar event {"kind":"step","step":"%s.%s"}' % (os.environ["SLURM_JOB_ID"], os.environ["SLURM_STEP_ID"]), flush=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the step's SIGTERM is for the guard; report its end
pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setsid()
    os.execvp(task["argv"][0], task["argv"])
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
code = 128 - code if code < 0 else code
print('@hpar event {"kind":"exit","code":%d}' % code, flush=True)
sys.exit(code)
"""
# Slurm variables that describe salloc's own tasks; the step states its own
_DROP = (
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_DISTRIBUTION",
    "SLURM_CPUS_PER_TASK",
    "SLURM_HOSTFILE",
    "SLURM_ARBITRARY_NODELIST",
)


def step_environment(extra: dict | None = None, environ=None) -> dict:
    """srun's environment (so every task's, before its own variables): the launcher's
    ``SLURM_*`` (which job to run in), the login basics (PATH, HOME, USER, ...) and the
    forwarded allowlist plus ``--env`` (launcher/hosts/environ.py); nothing else."""
    environ = os.environ if environ is None else environ
    basics = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR")
    env = {k: v for k, v in environ.items() if k.startswith("SLURM_") and k not in _DROP}
    env.update({k: environ[k] for k in basics if k in environ})
    env.update(forwarded(extra, environ))
    return env


def task_table(specs: list[ProcessSpec], env: dict | None, cwd: str) -> list[dict]:
    """``TASKS.json``'s entries: each spec's argv, ``cwd`` and its own variables without those
    that the step's environment already carries with the same value (``env``: the ``--env``
    values, see :func:`step_environment`), so that no ``--env`` value is written to the file."""
    env = {k: str(v) for k, v in (env or {}).items()}
    return [
        {
            "argv": list(s.argv),
            "cwd": cwd,
            "env": {
                "HPAR_GUARD_HEARTBEAT": str(HEARTBEAT_S),
                **{k: str(v) for k, v in s.env.items() if env.get(k) != str(v)},
            },
        }
        for s in specs
    ]


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, readable by this user only (0600 from creation:
    strategies/state/checkpoint.py ``atomic_write_bytes(..., private=True)``)."""
    atomic_write_bytes(path, data, private=True)


def srun_argv(ntasks: int, tasks_file: str, python: str) -> list[str]:
    """The srun command line of a step of ``ntasks`` tasks running BOOT on ``tasks_file``."""
    return [
        shutil.which("srun") or "srun",
        "--ntasks",
        str(ntasks),
        "--distribution=arbitrary",
        "--label",
        "--input=all",
        "--kill-on-bad-exit=0",
        "--overcommit",
        "--overlap",
        "--cpus-per-task=1",
        "--export=ALL",
        "--job-name=hpar",
        python,
        "-c",
        BOOT,
        tasks_file,
    ]
