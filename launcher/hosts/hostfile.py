"""Host lists: one parser for ``--hosts`` (host files, inline lists, the ``HxG`` shorthand),
shared by ``hpar run`` and ``hpar profile``, and the placement of worker ranks on hosts.

Grammar of one entry (a line of a host file, or a comma-separated item of ``--hosts``)::

    [user@]host[:N] [slots=S] [port=P] [user=U]

- ``host`` is an RFC 1123 host name, an IPv4 literal, or an IPv6 literal (bare, e.g. ``::1``,
  or in brackets, ``[fe80::1]:4``, when a ``:N`` suffix follows).
- ``:N`` is the **slot count** (Horovod's ``host:4``), except that it is the **SSH port** when the
  entry has a ``user@`` prefix (``root@node1:2222``, as in an SSH URL) or the line also gives
  ``slots=S``. So ``node1:4`` has 4 slots, ``root@node1:2222`` has port 2222 and 1 slot, and
  ``root@node1:2222 slots=4`` has both; ``port=P`` and ``user=U`` say the same explicitly.
- A bare host has 1 slot. In a file, ``#`` starts a comment and blank lines are ignored.

``--hosts`` is a host file when it names an existing file (or looks like a path: contains ``/``
or ends in ``.txt``/``.hosts``), ``HxG`` (e.g. ``6x8``: H hosts ``host0..host{H-1}`` of G slots,
for projections only: they are never contacted), or else an inline list ``a:2,b:2``.
Host names and users are validated so that no value from a host file can carry shell syntax
onto a remote command line (every value is also shlex-quoted where it is used).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import dataclass

_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]{0,31}$")
_NUMBER = re.compile(r"^[0-9]+$")
_SHORTHAND = re.compile(r"^([0-9]+)x([0-9]+)$")
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class Host:
    """One host: its ``name`` (host name or address as given), its ``slots`` (worker ranks it
    takes), and the SSH ``user`` and ``port`` it was given (None: use the defaults, flags or
    ~/.ssh/config)."""

    name: str
    slots: int = 1
    user: str | None = None
    port: int | None = None

    @property
    def is_local(self) -> bool:
        """True for this machine: localhost, 127.0.0.1, ::1 or this machine's host name."""
        name = self.name.lower()
        if name in _LOCAL_NAMES:
            return True
        try:
            return name in {socket.gethostname().lower(), socket.getfqdn().lower()}
        except OSError:
            return False

    def __str__(self) -> str:
        user = f"{self.user}@" if self.user else ""
        port = f" port={self.port}" if self.port else ""
        return f"{user}{self.name} slots={self.slots}{port}"


def valid_host_name(name: str) -> bool:
    """True when ``name`` is an RFC 1123 host name or an IPv4/IPv6 literal (nothing else: no
    spaces, shell metacharacters, leading '-' or control characters)."""
    if not name or len(name) > 253:
        return False
    if ":" in name:
        try:
            ipaddress.IPv6Address(name)
            return True
        except ValueError:
            return False
    if re.fullmatch(r"[0-9.]+", name):
        try:
            ipaddress.IPv4Address(name)
            return True
        except ValueError:
            return False
    labels = name[:-1].split(".") if name.endswith(".") else name.split(".")
    return all(_LABEL.match(label) for label in labels)


def _number(text: str, what: str, where: str, low: int, high: int) -> int:
    if not _NUMBER.match(text):
        raise ValueError(f"{where}: {what} {text!r} is not a whole number")
    value = int(text)
    if not low <= value <= high:
        raise ValueError(f"{where}: {what} {value} is out of range ({low}..{high})")
    return value


def _split_host(text: str, where: str) -> tuple[str, str | None]:
    """``host[:N]`` or ``[v6]:N`` or a bare IPv6 literal -> (host, N or None)."""
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ValueError(f"{where}: unclosed '[' in {text!r}; write IPv6 hosts as [addr]:N")
        rest = text[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{where}: unexpected {rest!r} after {text[: close + 1]!r}")
        return text[1:close], (rest[1:] if rest else None)
    if text.count(":") > 1:
        return text, None  # a bare IPv6 literal; validated below
    if ":" in text:
        host, suffix = text.split(":", 1)
        return host, suffix
    return text, None


def parse_entry(entry: str, where: str) -> Host:
    """Parse one entry (see the module docstring); ``where`` names it in errors (``file:line``
    or ``--hosts``). Raises ValueError naming ``where`` and the problem."""
    if any(ord(c) < 32 or ord(c) == 127 for c in entry):
        raise ValueError(f"{where}: control character in host entry {entry!r}")
    fields = entry.split()
    if not fields:
        raise ValueError(f"{where}: empty host entry")
    first, options = fields[0], fields[1:]
    user = None
    if "@" in first:
        user, _, first = first.rpartition("@")
        if not _USER.match(user):
            raise ValueError(f"{where}: invalid user name {user!r}")
    name, suffix = _split_host(first, where)
    if not valid_host_name(name):
        raise ValueError(f"{where}: invalid host name {name!r}; use an RFC 1123 name or an IP address")
    keys: dict[str, str] = {}
    for option in options:
        key, eq, value = option.partition("=")
        if not eq or key not in ("slots", "port", "user") or not value:
            raise ValueError(f"{where}: unknown option {option!r}; use slots=N, port=P or user=U")
        if key in keys:
            raise ValueError(f"{where}: {key}= given twice")
        keys[key] = value
    slots = port = None
    if suffix is not None:
        if user is not None or "slots" in keys:
            port = _number(suffix, "port", where, 1, 65535)
        else:
            slots = _number(suffix, "slot count", where, 1, 1_000_000)
    if "slots" in keys:
        slots = _number(keys["slots"], "slot count", where, 1, 1_000_000)
    if "port" in keys:
        if port is not None:
            raise ValueError(f"{where}: port given twice (':{port}' and port=)")
        port = _number(keys["port"], "port", where, 1, 65535)
    if "user" in keys:
        if user is not None:
            raise ValueError(f"{where}: user given twice ('{user}@' and user=)")
        user = keys["user"]
        if not _USER.match(user):
            raise ValueError(f"{where}: invalid user name {user!r}")
    return Host(name=name, slots=slots or 1, user=user, port=port)


def _check_duplicates(hosts: list[tuple[Host, str]]) -> list[Host]:
    seen: dict[tuple[str, int | None], str] = {}
    for host, where in hosts:
        key = (host.name.lower().rstrip("."), host.port)
        if key in seen:
            raise ValueError(f"{where}: duplicate host {host.name!r} (first at {seen[key]}); give it once with slots=N")
        seen[key] = where
    return [host for host, _ in hosts]


def parse_host_file(path: str) -> list[Host]:
    """Parse a host file (one entry per line, ``#`` comments, blank lines). Raises ValueError
    naming the file and line for every problem, or when the file is missing or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"--hosts: host file {path!r} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--hosts: cannot read host file {path!r}: {e}") from None
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            where = f"{path}:{number}"
            entries.append((parse_entry(line, where), where))
    if not entries:
        raise ValueError(f"--hosts: host file {path!r} lists no hosts")
    return _check_duplicates(entries)


def parse_hosts(spec: "str | list[Host] | tuple[Host, ...]") -> list[Host]:
    """The hosts of ``--hosts SPEC``: a host file path, the ``HxG`` shorthand, or an inline
    list ``a:2,b:2`` (see the module docstring). Returns them in order. Raises ValueError
    (naming ``--hosts`` or the file and line) for malformed, hostile or duplicate entries.
    Hosts parsed already (a list or tuple of Host) come back as a list, unchanged."""
    if isinstance(spec, (list, tuple)):
        assert all(isinstance(h, Host) for h in spec), "parse_hosts takes a string or Host values"
        return list(spec)
    spec = spec.strip()
    if not spec:
        raise ValueError("--hosts: empty; give a host file, a list like a:2,b:2, or HxG")
    if os.path.isfile(spec) or "/" in spec or spec.endswith((".txt", ".hosts")):
        return parse_host_file(spec)
    match = _SHORTHAND.match(spec)
    if match:
        count, slots = int(match.group(1)), int(match.group(2))
        if count < 1 or slots < 1:
            raise ValueError(f"--hosts: {spec!r} needs at least 1 host of at least 1 slot")
        return [Host(name=f"host{i}", slots=slots) for i in range(count)]
    items = spec.split(",")
    entries = []
    for index, item in enumerate(items, 1):
        where = f"--hosts (item {index})"
        if not item.strip():
            raise ValueError(f"{where}: empty item in {spec!r}")
        entries.append((parse_entry(item.strip(), where), where))
    return _check_duplicates(entries)


def total_slots(hosts: list[Host]) -> int:
    """The number of worker slots over all ``hosts``."""
    return sum(host.slots for host in hosts)


def place_workers(hosts: list[Host], gpus: int) -> list[Host]:
    """The host of each of ``gpus`` worker ranks: fills ``hosts`` in order, each up to its
    slots (so fewer ranks than slots use the first hosts). Raises ValueError naming ``--gpus``
    when ``gpus`` < 1 or exceeds the total slots."""
    if gpus < 1:
        raise ValueError(f"--gpus: must be at least 1, got {gpus}")
    slots = total_slots(hosts)
    if gpus > slots:
        raise ValueError(
            f"--gpus: {gpus} workers exceed the {slots} slots of --hosts "
            f"({len(hosts)} hosts); lower --gpus or add hosts/slots"
        )
    placement: list[Host] = []
    for host in hosts:
        take = min(host.slots, gpus - len(placement))
        placement.extend([host] * take)
        if len(placement) == gpus:
            break
    return placement
