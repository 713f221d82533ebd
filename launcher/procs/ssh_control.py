"""Control commands on a host over an SSH connection that is already open: the one a
RemoteProcess (launcher/procs/ssh.py) was started with. A command is one more channel on that
connection, so a signal or the teardown's check costs no new TCP connection, key exchange or
authentication (OpenSSH's ControlMaster idea, with paramiko's transport as the master).
"""
from __future__ import annotations

import socket

import paramiko


def usable(transport: paramiko.Transport | None) -> bool:
    """Whether ``transport`` is connected and authenticated (channels can be opened on it)."""
    return transport is not None and transport.is_active() and transport.is_authenticated()


def exec_on(transport: paramiko.Transport, command: str, timeout: float) -> tuple[int, str] | None:
    """Run the shell ``command`` on the host of ``transport`` in a channel of its own and wait
    for it (``timeout`` seconds in all). Returns (exit code, stdout and stderr as text), or None
    when the channel cannot be opened, the connection breaks or the command does not end in
    time (the host is then as good as unreachable)."""
    try:
        channel = transport.open_session(timeout=timeout)
    except (OSError, EOFError, paramiko.SSHException):
        return None
    try:
        channel.set_combine_stderr(True)
        channel.settimeout(timeout)
        channel.exec_command(command)
        out = bytearray()
        while True:
            data = channel.recv(65536)
            if not data:
                break
            out += data
        if not channel.status_event.wait(timeout):
            return None
        return channel.exit_status, out.decode("utf-8", "replace")
    except (OSError, EOFError, socket.timeout, paramiko.SSHException):
        return None
    finally:
        channel.close()
