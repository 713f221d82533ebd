"""Test hosts on one machine: K network namespaces on a bridge, each with its own OpenSSH server.

    python scripts/testhosts.py up K [--rate 1gbit [--queue fifo|fair]] [--prefix hpt] [--net 0] [--shell dash]
    python scripts/testhosts.py down [--prefix hpt]
    python scripts/testhosts.py link I up|down [--prefix hpt]

``up`` makes a bridge ``<prefix>br`` in the root namespace at 10.77.NET.1/24 and, for host i,
a namespace ``<prefix>h<i>`` joined to it by a veth pair (``<prefix>v<i>`` on the bridge,
``eth0`` inside) with the address 10.77.NET.(i+2), running ``/usr/sbin/sshd`` with a throwaway
config, a throwaway host key and a throwaway client key authorized for root. ``--rate`` caps
each host's link in both directions (``tc`` on both ends of its veth), behind a first-in
first-out queue or, with ``--queue fair``, a per-flow fair one (scripts/linkqueue.py). ``--shell
dash``: commands run under ``dash -c`` (``ForceCommand``), as with a dash login shell, whose process
keeps the command in its argv for the whole run (sftp still works). It writes
a host file (``root@ADDR:22 slots=1`` per line), an ssh config, a known_hosts file with the
hosts' key (pass it with ``--ssh-known-hosts`` or ``HPAR_SSH_KNOWN_HOSTS``) and the key under
hpar-testhosts-<prefix>/ in $HPAR_TESTHOSTS_DIR (default: the temporary directory) and prints them as JSON. The namespaces have no default route:
traffic only ever goes to the addresses made here. They share this machine's filesystem, so
``sys.executable`` and the repository path work inside them.

``down`` kills the sshd processes it recorded and every process left inside its namespaces
(found with ``ip netns pids``, never by name), deletes the namespaces, veths and bridge, and
removes the directory. Both commands are idempotent; ``up`` on existing hosts re-creates them.
Needs root, iproute2, tc, sshd and ssh-keygen; ``unavailable()`` says what is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported by path
import linkqueue  # noqa: E402

SSHD = "/usr/sbin/sshd"


@dataclass(frozen=True)
class TestHost:
    """One test host: its namespace, root-side veth, address and sshd PID."""

    namespace: str
    veth: str
    address: str
    sshd_pid: int


@dataclass(frozen=True)
class TestHosts:
    """What ``up`` made: the hosts, and the files a launcher needs to reach them."""

    prefix: str
    net: int
    directory: str
    bridge: str
    bridge_address: str
    hosts: tuple[TestHost, ...]
    key: str
    host_file: str
    ssh_config: str
    user: str = "root"
    port: int = 22
    known_hosts: str = ""  # the hosts' keys, for --ssh-known-hosts / HPAR_SSH_KNOWN_HOSTS

    @property
    def addresses(self) -> list[str]:
        return [h.address for h in self.hosts]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def unavailable() -> str | None:
    """Why test hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces, veth, bridge)"
    for tool in ("ip", "tc", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install -y iproute2 openssh-server)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} not found (apt-get install -y openssh-server)"
    probe = f"hptprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "cannot create network namespaces here (no CAP_SYS_ADMIN/CAP_NET_ADMIN?)"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result


def _directory(prefix: str) -> str:
    """Where the keys, configs and host file of the test hosts ``prefix`` live:
    $HPAR_TESTHOSTS_DIR, else the system's temporary directory."""
    base = os.environ.get("HPAR_TESTHOSTS_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"hpar-testhosts-{prefix}")


def _check_names(prefix: str, net: int, k: int) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
        raise ValueError(f"--prefix: {prefix!r} must be 1-8 lower-case letters/digits, starting with a letter")
    if not 0 <= net <= 255:
        raise ValueError(f"--net: {net} must be 0..255 (the third octet of 10.77.NET.0/24)")
    if not 1 <= k <= 200:
        raise ValueError(f"K: {k} must be 1..200")


def _rate_bits(rate: str) -> int:
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*(bit|kbit|mbit|gbit)", rate.strip().lower())
    if not match:
        raise ValueError(f"--rate: {rate!r} must look like 100mbit or 1gbit")
    scale = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}[match.group(2)]
    return int(float(match.group(1)) * scale)


def _cap(rate_bits: int, device: str, namespace: str | None, queue: str) -> None:
    """Cap ``device``'s egress at ``rate_bits`` bits/s behind the queue ``queue``
    (scripts/linkqueue.py), in one ``tc -batch``."""
    with tempfile.NamedTemporaryFile("w", suffix=".tc") as batch:
        batch.write("\n".join(linkqueue.commands(queue, rate_bits, device)) + "\n")
        batch.flush()
        _sh(*(["ip", "netns", "exec", namespace] if namespace else []), "tc", "-batch", batch.name)


DASH = (
    'ForceCommand case "$SSH_ORIGINAL_COMMAND" in internal-sftp) exec /usr/lib/openssh/sftp-server;; '
    '*) exec /bin/dash -c "$SSH_ORIGINAL_COMMAND";; esac\n'
)


def _sshd_config(directory: str, address: str, index: int, shell: str | None = None) -> str:
    path = os.path.join(directory, f"sshd-{index}.conf")
    with open(path, "w") as f:
        f.write(
            (DASH if shell == "dash" else "")
            + f"""Port 22
ListenAddress {address}
HostKey {directory}/host_key
AuthorizedKeysFile {directory}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
MaxStartups 200
MaxSessions 200
# a dead link closes the session (and so the guard's stdin) within ~3 s
ClientAliveInterval 1
ClientAliveCountMax 3
Subsystem sftp internal-sftp
"""
        )
    return path


_CHILDREN: dict[int, subprocess.Popen] = {}


def _start_sshd(namespace: str, config: str, log: str, address: str, timeout: float = 30.0) -> int:
    """Start sshd in the foreground (-D) as our child in its own session, so that ``down`` in
    this process reaps it; wait until it accepts connections (on the 2-core CI machine under the
    whole suite one took over 10 s). Returns its PID."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", namespace, SSHD, "-D", "-f", config, "-E", log],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _CHILDREN[proc.pid] = proc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd in {namespace} exited with {proc.returncode}; see {log}")
        try:
            socket.create_connection((address, 22), timeout=0.5).close()
            return proc.pid
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd in {namespace} did not accept connections within {timeout} s; see {log}")


def up(
    k: int, rate: str | None = None, prefix: str = "hpt", net: int = 0, queue: str = "fifo", shell: str | None = None
) -> TestHosts:
    """Create ``k`` test hosts (removing any left from an earlier ``up`` with this prefix), each
    link capped at ``rate`` behind the queue ``queue`` (scripts/linkqueue.py), commands under
    ``dash -c`` with ``shell="dash"`` (see the module docstring). Raises
    PermissionError without root, ValueError for bad arguments, RuntimeError when a command
    fails (after removing what it made)."""
    _check_names(prefix, net, k)
    assert shell in (None, "dash"), f"shell {shell!r}: only dash"
    rate_bits = _rate_bits(rate) if rate else None
    if rate_bits:
        linkqueue.commands(queue, rate_bits, "eth0")  # ValueError before anything is made
    if os.geteuid() != 0:
        raise PermissionError("testhosts: needs root (run as root or with sudo)")
    down(prefix)
    directory = _directory(prefix)
    os.makedirs(directory, mode=0o700)
    os.makedirs("/run/sshd", exist_ok=True)
    subnet = f"10.77.{net}"
    state = {"prefix": prefix, "net": net, "bridge": f"{prefix}br", "namespaces": [], "veths": [], "sshd_pids": []}
    _save(directory, state)
    try:
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{directory}/host_key")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{directory}/client_key", "-C", "hpar-testhosts")
        shutil.copy(f"{directory}/client_key.pub", f"{directory}/authorized_keys")
        bridge = state["bridge"]
        _sh("ip", "link", "add", bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        hosts = []
        for i in range(k):
            ns, veth, address = f"{prefix}h{i}", f"{prefix}v{i}", f"{subnet}.{i + 2}"
            _sh("ip", "netns", "add", ns)
            state["namespaces"].append(ns)
            _save(directory, state)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            state["veths"].append(veth)
            _save(directory, state)
            _sh("ip", "link", "set", veth, "master", bridge)
            _sh("ip", "link", "set", veth, "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            if rate_bits:
                _cap(rate_bits, veth, None, queue)
                _cap(rate_bits, "eth0", ns, queue)
            config = _sshd_config(directory, address, i, shell)
            pid = _start_sshd(ns, config, f"{directory}/sshd-{i}.log", address)
            state["sshd_pids"].append(pid)
            _save(directory, state)
            hosts.append(TestHost(ns, veth, address, pid))
    except BaseException:
        down(prefix)
        raise
    host_file = os.path.join(directory, "hosts.txt")
    with open(host_file, "w") as f:
        f.write("# hpar test hosts (scripts/testhosts.py)\n")
        f.writelines(f"root@{h.address}:22 slots=1\n" for h in hosts)
    ssh_config = os.path.join(directory, "ssh_config")
    with open(ssh_config, "w") as f:
        f.write(
            f"Host {subnet}.*\n  User root\n  IdentityFile {directory}/client_key\n  IdentitiesOnly yes\n"
            f"  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        )
    known_hosts = os.path.join(directory, "known_hosts")  # every host shares the one host key
    host_key = open(f"{directory}/host_key.pub").read().split()[:2]
    with open(known_hosts, "w") as f:
        f.writelines(f"{h.address} {' '.join(host_key)}\n" for h in hosts)
    return TestHosts(
        prefix,
        net,
        directory,
        state["bridge"],
        f"{subnet}.1",
        tuple(hosts),
        f"{directory}/client_key",
        host_file,
        ssh_config,
        known_hosts=known_hosts,
    )


def _save(directory: str, state: dict) -> None:
    with open(os.path.join(directory, "state.json"), "w") as f:
        json.dump(state, f)


def _is_our_sshd(pid: int, directory: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return directory.encode() in f.read()
    except OSError:
        return False


def namespace_pids(namespace: str) -> list[int]:
    """PIDs of the processes inside ``namespace`` (empty when it does not exist)."""
    result = _sh("ip", "netns", "pids", namespace, check=False)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


def down(prefix: str = "hpt") -> None:
    """Remove everything ``up(prefix=...)`` made: kill its recorded sshd PIDs and the processes
    left in its namespaces, delete namespaces, veths and bridge, remove the directory. Safe to
    call when nothing is there."""
    directory = _directory(prefix)
    try:
        with open(os.path.join(directory, "state.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = {"bridge": f"{prefix}br", "namespaces": [], "veths": [], "sshd_pids": []}
    listed = _sh("ip", "netns", "list", check=False).stdout.split()
    state["namespaces"] += [n for n in listed if re.fullmatch(rf"{prefix}h[0-9]+", n)]
    for pid in state["sshd_pids"]:
        if _is_our_sshd(pid, directory):
            os.kill(pid, signal.SIGKILL)
        child = _CHILDREN.pop(pid, None)
        if child is not None:
            child.wait()
    for ns in dict.fromkeys(state["namespaces"]):
        for pid in namespace_pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _sh("ip", "netns", "del", ns, check=False)
    for veth in state["veths"]:
        _sh("ip", "link", "del", veth, check=False)
    _sh("ip", "link", "del", state["bridge"], check=False)
    shutil.rmtree(directory, ignore_errors=True)


def set_link(prefix: str, index: int, is_up: bool) -> None:
    """Take host ``index``'s link down (or bring it back up): both ends of its veth."""
    state = "up" if is_up else "down"
    _sh("ip", "link", "set", f"{prefix}v{index}", state)
    _sh("ip", "netns", "exec", f"{prefix}h{index}", "ip", "link", "set", "eth0", state)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="create K test hosts")
    p_up.add_argument("k", type=int)
    p_up.add_argument("--rate", default=None, help="cap each host's link, e.g. 1gbit")
    p_up.add_argument("--net", type=int, default=0, help="third octet of 10.77.NET.0/24")
    p_up.add_argument(
        "--queue",
        choices=linkqueue.QUEUES,
        default="fifo",
        help="the queue behind --rate: fifo (tbf) or fair (per-flow, small packets first; see linkqueue.py)",
    )
    p_up.add_argument("--shell", choices=["dash"], default=None, help="run commands under dash -c (ForceCommand)")
    p_down = sub.add_parser("down", help="remove the test hosts")
    p_link = sub.add_parser("link", help="take a host's link down or up")
    p_link.add_argument("index", type=int)
    p_link.add_argument("state", choices=["up", "down"])
    for p in (p_up, p_down, p_link):
        p.add_argument("--prefix", default="hpt")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("testhosts: needs root (network namespaces, veth, bridge); run it as root", file=sys.stderr)
        return 2
    try:
        if args.command == "up":
            print(
                up(
                    args.k, rate=args.rate, prefix=args.prefix, net=args.net, queue=args.queue, shell=args.shell
                ).to_json()
            )
        elif args.command == "down":
            down(args.prefix)
        else:
            set_link(args.prefix, args.index, args.state == "up")
    except (ValueError, RuntimeError) as e:
        print(f"testhosts: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
