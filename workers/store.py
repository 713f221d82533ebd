"""The rendezvous store's server, listening on one address only, and the loopback interface.

torch's ``TCPStore`` server ignores the host it is given: its libuv backend (the default since
torch 2.4) listens on the wildcard address (``UvTcpServer::makeWithPort``,
torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp), and whoever reaches the port can list,
read and write the keys without credentials, e.g. rewrite gloo's peer addresses. So hpar binds
the socket itself, to one address (127.0.0.1 for a run on this machine, the first host's
cluster address otherwise), and hands it to the store as ``master_listen_fd``: the store then
listens there and nowhere else (checked with torch 2.13: ``ss -ltn`` shows ``127.0.0.1:PORT``,
not ``*:PORT``). The libuv backend takes a socket since pytorch/pytorch PR #150215; an older
torch raises NotImplementedError for it, and then the store runs on the older backend
(``use_libuv=False``), which takes it.

Used by the launcher (launcher/run/rendezvous.py) when the first host is this machine, and by
rank 0's guard (workers/guard.py) when it is another host. Source: torch.distributed
``TCPStore`` (``master_listen_fd``), torch's SECURITY.md ("Using distributed features").
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

HOLD_STORE = "HPAR_HOLD_STORE"  # "1": rank 0's guard holds the store at MASTER_ADDR:MASTER_PORT
WILDCARDS = ("", "0.0.0.0", "::")


def is_loopback(address: str) -> bool:
    """True for a loopback IP literal (127.0.0.0/8, ::1); False for anything else, host names
    included."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str:
    """The name of this machine's loopback interface, the one holding 127.0.0.1 (else ::1):
    ``lo`` on Linux, ``lo0`` on macOS and the BSDs; read with psutil, not assumed. Raises
    OSError when no interface holds either address."""
    import psutil

    found = psutil.net_if_addrs()
    for wanted in ("127.0.0.1", "::1"):
        for name, addrs in found.items():
            if any(a.address.split("%")[0] == wanted for a in addrs):
                return name
    raise OSError("no network interface holds 127.0.0.1 or ::1 (loopback down?)")


def listen_socket(address: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``address`` (an IPv4 or IPv6 literal, or a name resolving to
    one; never the wildcard) and ``port`` (0: the kernel picks one). Raises OSError when it
    cannot be bound (EADDRINUSE: the port is taken; EADDRNOTAVAIL: no interface here holds
    ``address``)."""
    assert address not in WILDCARDS, "the store listens on one address, never the wildcard"
    info = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT after a restart
        sock.bind(info[4])
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


def hold_store(address: str, port: int = 0, timeout_s: float = 60.0):
    """A ``torch.distributed.TCPStore`` server listening on ``address:port`` only (see the
    module docstring), not waiting for clients; its ``port`` is the one bound. ``timeout_s``:
    seconds a client operation may wait. Raises OSError when the socket cannot be bound, and
    whatever TCPStore raises."""
    from torch.distributed import TCPStore

    sock = listen_socket(address, port)
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        try:
            return TCPStore(
                address, bound, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=fd
            )
        except NotImplementedError:  # a libuv backend without socket support (before PR #150215)
            return TCPStore(
                address,
                bound,
                is_master=True,
                wait_for_workers=False,
                timeout=timeout,
                master_listen_fd=fd,
                use_libuv=False,
            )
    except BaseException:
        os.close(fd)
        raise


def guard_store(environ=None):
    """The store rank 0's guard holds for the run when the launcher asks for it
    (``HPAR_HOLD_STORE=1`` and this process is rank 0: ``HPAR_PG_RANK``, else ``RANK``), at
    ``MASTER_ADDR:MASTER_PORT``; None otherwise. Every rank then joins it as a client
    (``TORCHELASTIC_USE_AGENT_STORE=True``, as under torchrun's agent), so torch's own rank-0
    store, which would listen on every interface, is never made. Raises OSError (with the
    address and port in its message) when it cannot be bound."""
    environ = os.environ if environ is None else environ
    rank = environ.get("HPAR_PG_RANK", environ.get("RANK"))
    if environ.get(HOLD_STORE) != "1" or rank != "0":
        return None
    address, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    try:
        return hold_store(address, port)
    except OSError as exc:
        raise OSError(exc.errno, f"rendezvous store at {address}:{port}: {exc.strerror or exc}") from None
