"""Preflight: check every host in parallel before anything starts.

For each host: reachable over SSH (this machine's entries are checked in-process, without
SSH); the same Python (major.minor.micro), torch and hpar versions as the launcher (package
metadata: no slow ``import torch``); how many GPUs it has for its slots (``/dev/nvidiaN``
devices, limited by CUDA_VISIBLE_DEVICES) (fewer: CPU mode, stated, not a failure); the user's script at the
same path (``sync=True`` copies it with fabric's put when its SHA-256 differs, which also keeps a
shared filesystem from copying a file onto itself); the rendezvous port free on the first host;
and the network interface that reaches the first host's address (the interface holding the
source address the kernel picks for it: what ``ip route get`` names, found with a UDP socket and
psutil so no ``ip`` binary is needed), for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rich.table import Table

from hpar.launcher.hosts.hostfile import Host
from hpar.launcher.procs import ssh_pool
from hpar.launcher.procs.ssh import SSHError, SSHOptions

# Runs on each host as ``PY -c PROBE SCRIPT PORT ADDR``; prints one JSON line.
PROBE = r"""
import hashlib, json, os, socket, sys
script, port, addr = sys.argv[1], int(sys.argv[2]), sys.argv[3]
r = {"python": "%d.%d.%d" % sys.version_info[:3], "torch": None, "hpar": None, "gpus": 0, "ifname": None}
from importlib.metadata import version
for package in ("torch", "hpar"):
    try:
        r[package] = version(package)
    except Exception:
        pass
gpus = [d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()]
visible = os.environ.get("CUDA_VISIBLE_DEVICES")
r["gpus"] = len(gpus) if visible is None else min(len(gpus), len([v for v in visible.split(",") if v.strip()]))
r["script"] = hashlib.sha256(open(script, "rb").read()).hexdigest() if os.path.isfile(script) else None
if port:
    s = socket.socket()
    try:
        s.bind(("", port)); r["port_free"] = True
    except OSError:
        r["port_free"] = False
    finally:
        s.close()
try:
    u = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM)
    u.connect((addr, 9)); src = u.getsockname()[0]; u.close()
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == src for a in addrs):
            r["ifname"] = name
except Exception as e:
    r["ifname_error"] = "%s: %s" % (type(e).__name__, e)
print(json.dumps(r))
"""


@dataclass(frozen=True)
class HostCheck:
    """One host's preflight row; ``problem`` is "" when ``ok``."""

    host: str
    ok: bool
    problem: str = ""
    python: str = ""
    torch: str = ""
    hpar: str = ""
    gpus: int = 0
    ifname: str = ""


@dataclass(frozen=True)
class PreflightReport:
    """All rows, the rendezvous address (the first host's address as the others reach it) and
    the device mode ("gpu" when every host has a GPU per slot, else "cpu")."""

    rows: tuple[HostCheck, ...]
    master_addr: str
    mode: str

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows)

    @property
    def ifnames(self) -> dict[str, str]:
        """Host name -> the interface that reaches ``master_addr`` (hosts where it is known)."""
        return {row.host: row.ifname for row in self.rows if row.ifname}

    def summary(self) -> str:
        """One line: "preflight: ok ..." or the failed hosts and their problems."""
        bad = [row for row in self.rows if not row.ok]
        if not bad:
            return f"preflight: {len(self.rows)} host(s) ok, {self.mode.upper()} mode, rendezvous at {self.master_addr}"
        return f"preflight failed on {len(bad)} of {len(self.rows)} host(s): " + "; ".join(
            f"{row.host}: {row.problem}" for row in bad
        )

    def table(self) -> Table:
        """A rich table, one line per host."""
        table = Table(title="hpar preflight", show_lines=False)
        for column in ("host", "ok", "python", "torch", "hpar", "gpus", "ifname", "problem"):
            table.add_column(column, overflow="fold")
        for row in self.rows:
            table.add_row(
                row.host,
                "yes" if row.ok else "NO",
                row.python,
                row.torch,
                row.hpar,
                str(row.gpus),
                row.ifname,
                row.problem,
            )
        return table


def launcher_versions() -> dict:
    """The launcher's own Python, torch and hpar versions."""
    from importlib.metadata import PackageNotFoundError, version

    def get(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    return {"python": "%d.%d.%d" % sys.version_info[:3], "torch": get("torch"), "hpar": get("hpar")}


def resolve_master(hosts: list[Host]) -> str:
    """The first host's address as the other hosts reach it: its IP literal, its resolved
    IPv4 address, or (this machine first, with remote hosts) the source address this machine
    uses towards the second host. Raises ValueError when a name does not resolve."""

    def address(host: Host) -> str:
        try:
            return socket.getaddrinfo(host.name, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        except socket.gaierror:
            try:
                return socket.getaddrinfo(host.name, None)[0][4][0]
            except socket.gaierror:
                raise ValueError(
                    f"--hosts: host name {host.name!r} does not resolve; fix the name or use its address"
                ) from None

    first = hosts[0]
    remote = [h for h in hosts if not h.is_local]
    if first.is_local:
        if not remote:
            return "127.0.0.1"
        target = address(remote[0])
        with socket.socket(socket.AF_INET6 if ":" in target else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    return address(first)


def _row(host: Host, result: dict, want: dict, script: str, master_port: int, first: bool) -> HostCheck:
    problems = []
    for key in ("python", "torch", "hpar"):
        if result.get(key) is None:
            problems.append(f"{key} not found")
        elif want.get(key) is not None and result[key] != want[key]:
            problems.append(f"{key} {result[key]} differs from the launcher's {want[key]}")
    if result.get("script") is None:
        problems.append(f"script {script} not found (copy it there or pass --sync)")
    elif result["script"] != want["script"]:
        problems.append(f"script {script} differs from the launcher's copy (pass --sync)")
    if first and master_port and result.get("port_free") is False:
        problems.append(f"rendezvous port {master_port} is in use")
    if not result.get("ifname"):
        problems.append(f"no interface reaches the first host ({result.get('ifname_error', 'unknown')})")
    return HostCheck(
        host.name,
        not problems,
        "; ".join(problems),
        result.get("python") or "",
        result.get("torch") or "",
        result.get("hpar") or "",
        int(result.get("gpus") or 0),
        result.get("ifname") or "",
    )


def _check(
    host: Host, script: str, opts: SSHOptions, master_port: int, master: str, first: bool, sync: bool, want: dict
) -> HostCheck:
    python = opts.python or sys.executable
    port = master_port if first else 0
    if host.is_local and not opts.force_ssh:
        import subprocess

        out = subprocess.run([python, "-c", PROBE, script, str(port), master], capture_output=True, text=True)
        if out.returncode != 0:
            return HostCheck(host.name, False, f"python {python} failed: {_last(out.stderr)}")
        return _row(host, json.loads(out.stdout), want, script, master_port, first)
    try:
        conn = ssh_pool.connection(host, opts)  # kept open: the host's processes start over it
    except SSHError as e:
        return HostCheck(host.name, False, str(e))
    try:
        command = " ".join(shlex.quote(a) for a in (python, "-c", PROBE, script, str(port), master))
        out = conn.run(command, hide=True, warn=True, in_stream=False)
        if out.exited == 127:
            return HostCheck(host.name, False, f"python {python} not found on the host (pass --python)")
        if out.exited != 0:
            return HostCheck(host.name, False, f"python {python} failed: {_last(out.stderr)}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if sync and result.get("script") != want["script"]:
            conn.run(f"mkdir -p {shlex.quote(os.path.dirname(script))}", hide=True, in_stream=False)
            conn.put(script, remote=script)
            result["script"] = want["script"]
        return _row(host, result, want, script, master_port, first)
    except Exception as e:  # a host that breaks mid-check is one failed row, not a crash
        ssh_pool.forget(conn)
        return HostCheck(host.name, False, f"check failed: {type(e).__name__}: {_last(str(e))}")


def _last(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def preflight(
    hosts: list[Host], script: str, opts: SSHOptions, master_port: int, sync: bool = False
) -> PreflightReport:
    """Check ``hosts`` (in parallel threads) for running ``script`` (an absolute path, the same
    on every host); ``master_port`` (0: skip the check) must be free on the first host.
    Never raises for a host's problem: each is a row of the report. Raises ValueError when the
    first host's name does not resolve or ``script`` does not exist here."""
    assert hosts, "preflight needs at least one host"
    script = os.path.abspath(script)
    if not os.path.isfile(script):
        raise ValueError(f"{script}: script not found")
    with open(script, "rb") as f:
        want = dict(launcher_versions(), script=hashlib.sha256(f.read()).hexdigest())
    master = resolve_master(hosts)
    with ThreadPoolExecutor(max_workers=min(256, len(hosts))) as pool:  # every host at once
        futures = [
            pool.submit(_check, host, script, opts, master_port, master, i == 0, sync, want)
            for i, host in enumerate(hosts)
        ]
        rows = tuple(f.result() for f in futures)
    mode = "gpu" if all(row.gpus >= host.slots for row, host in zip(rows, hosts)) else "cpu"
    return PreflightReport(rows, master, mode)
