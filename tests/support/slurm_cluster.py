"""A real Slurm on this machine for the tests (not a test module): munged, slurmctld and
slurmd started from a generated slurm.conf in a temporary directory, stopped by the PIDs in
their pid files. Needs root and Debian's ``slurm-wlm`` and ``munge``; ``start()`` raises
``Unavailable`` with the reason where they cannot start (tests skip with it).

Everything is private to one cluster: munged gets its own key, socket and pid file
(``AuthInfo=socket=...`` points Slurm at it), the daemons get free ports, and ``SLURM_CONF``
in ``env()`` points the client tools (``salloc``, ``srun``, ``sbatch``, ``scontrol``) at the
generated config. The one node is this machine (``hostname -s``, address 127.0.0.1) in a
``debug`` partition.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

TOOLS = ("munged", "slurmctld", "slurmd", "srun", "salloc", "sbatch", "scontrol", "sinfo")


class Unavailable(RuntimeError):
    """Slurm cannot run here; the message says why."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Cluster:
    """A running one-node cluster: its directory, config, node name and CPUs."""

    directory: str
    conf: str
    node: str
    cpus: int
    munge_socket: str

    def env(self, **extra: str) -> dict:
        """This environment with SLURM_CONF pointing at the cluster (and no SLURM_* of an
        allocation the tests may themselves run in)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return dict(env, SLURM_CONF=self.conf, **extra)

    def run(self, *argv: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            argv, env=kw.pop("env", None) or self.env(), capture_output=True, text=True, timeout=timeout, **kw
        )


def unavailable() -> str | None:
    """Why a Slurm cannot be started here (None when it can)."""
    if os.geteuid() != 0:
        return "a test Slurm needs root (slurmd runs jobs as any user)"
    missing = [t for t in TOOLS if shutil.which(t) is None and not os.access(f"/usr/sbin/{t}", os.X_OK)]
    if missing:
        return f"{', '.join(missing)} not found (apt-get install -y slurm-wlm munge)"
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _wait(predicate, timeout: float, what: str, log: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    tail = ""
    if log and os.path.exists(log):
        tail = " | ".join(open(log, errors="replace").read().strip().splitlines()[-5:])
    raise Unavailable(f"{what} did not come up in {timeout:.0f} s{': ' + tail if tail else ''}")


def start(timeout: float = 30.0) -> Cluster:
    """Start munged, slurmctld and slurmd; return once the node is idle. Raises Unavailable
    (everything started so far is stopped again)."""
    reason = unavailable()
    if reason:
        raise Unavailable(reason)
    d = tempfile.mkdtemp(prefix="hpar-slurm-")
    os.chmod(d, 0o755)
    try:
        return _start(d, timeout)
    except BaseException:
        stop_directory(d)
        raise


def _start(d: str, timeout: float) -> Cluster:
    node = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    for sub in ("munge", "state", "spool", "log"):
        os.makedirs(os.path.join(d, sub), mode=0o700, exist_ok=True)
    key = os.path.join(d, "munge", "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(128))
    os.chmod(key, 0o400)
    sock = os.path.join(d, "munge", "munge.socket")
    out = subprocess.run(
        [
            _tool("munged"),
            "--force",
            f"--key-file={key}",
            f"--socket={sock}",
            f"--pid-file={d}/munge/munged.pid",
            f"--log-file={d}/log/munged.log",
            f"--seed-file={d}/munge/munged.seed",
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise Unavailable(f"munged failed: {out.stderr.strip() or out.stdout.strip()}")
    conf = os.path.join(d, "slurm.conf")
    ctl_port, node_port = _free_port(), _free_port()
    with open(conf, "w") as f:
        f.write(f"""ClusterName=hpartest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctl_port}
SlurmdPort={node_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SlurmUser=root
SlurmdUser=root
ReturnToService=2
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
KillWait=5
InactiveLimit=0
MinJobAge=5
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={max(1, mem - 512)} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    env = dict(os.environ, SLURM_CONF=conf)
    for daemon in ("slurmctld", "slurmd"):
        out = subprocess.run([_tool(daemon), "-f", conf], env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise Unavailable(f"{daemon} failed: {(out.stderr or out.stdout).strip()[-300:]}")
    cluster = Cluster(d, conf, node, cpus, sock)

    def idle() -> bool:
        out = cluster.run("sinfo", "-h", "-N", "-o", "%t", timeout=10)
        return out.returncode == 0 and out.stdout.strip() in ("idle", "mix")

    _wait(idle, timeout, "the Slurm node", os.path.join(d, "log", "slurmctld.log"))
    return cluster


def _pid(path: str) -> int | None:
    try:
        return int(open(path).read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stop_directory(d: str) -> None:
    """Stop the daemons of the cluster in ``d`` by their pid files (SIGTERM, then SIGKILL)
    and remove ``d``."""
    pids = (
        [
            p
            for p in (
                _pid(os.path.join(d, name))
                for name in [n for n in os.listdir(d) if n.endswith(".pid")]
                if os.path.isdir(d)
            )
            if p
        ]
        if os.path.isdir(d)
        else []
    )
    munge = _pid(os.path.join(d, "munge", "munged.pid"))
    for pid in pids + ([munge] if munge else []):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for pid in pids + ([munge] if munge else []):
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.1)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(d, ignore_errors=True)


def stop(cluster: Cluster) -> None:
    """Stop ``cluster``'s daemons and remove its directory."""
    stop_directory(cluster.directory)
