"""Control commands on a host over an SSH connection that is already open: the host's shared
one (launcher/procs/ssh_pool.py), which its processes were started with. A command is one more
channel on that connection, so a signal or the teardown's command costs no new TCP connection,
key exchange or authentication (OpenSSH's ControlMaster idea, paramiko's transport the master).
"""

from __future__ import annotations

import socket
import time

import paramiko


def exec_on(transport: paramiko.Transport, command: str, timeout: float) -> tuple[int, str] | None:
    """Run the shell ``command`` on the host of ``transport`` in a channel of its own and wait
    for it (at most ``timeout`` seconds for the channel, for each piece of output and for the
    exit status). A channel the host refuses for now (sshd's ``MaxSessions``, 10 by default: the
    host's processes hold most of them) is asked for again until ``timeout``. Returns (exit code,
    stdout and stderr as text), or None when the channel cannot be opened, the connection breaks
    or the command falls silent for longer (the host is then as good as unreachable)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            channel = transport.open_session(timeout=timeout)
            break
        except paramiko.ChannelException:  # sshd's MaxSessions (10 by default) reached: wait for a free one
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
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
