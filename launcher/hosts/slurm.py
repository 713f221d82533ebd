"""Hosts from a Slurm allocation: inside ``salloc``/``sbatch`` (``SLURM_JOB_ID`` set) the hosts
and the slots per host come from Slurm's environment instead of ``--hosts``.

- ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``) is a Slurm host list, expanded exactly as
  ``scontrol show hostnames`` does (:func:`expand_nodelist`): ``n[01-03,7],gpu-a[1-2]`` ->
  n01 n02 n03 n7 gpu-a1 gpu-a2 (zero padding kept from the range's first number, several
  bracket groups in one name give their product, in order).
- Slots per host: ``SLURM_GPUS_ON_NODE`` when the job has GPUs, else
  ``SLURM_NTASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE`` (``2(x3),1``: per node, in node
  order), else 1.

Processes of such a run start with ``srun`` (launcher/procs/srun.py), not SSH. Source of the
formats: Slurm's ``hostlist.c`` and the ``sbatch``/``srun`` man pages (OUTPUT ENVIRONMENT).
"""

from __future__ import annotations

import os
import re

from hpar.launcher.hosts.hostfile import Host, valid_host_name

_RANGE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")
_REPEAT = re.compile(r"^([0-9]+)(?:\(x([0-9]+)\))?$")
MAX_HOSTS = 1_000_000


def _split_top(text: str) -> list[str]:
    """Split ``text`` on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"Slurm node list {text!r}: nested '['")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"Slurm node list {text!r}: ']' without '['")
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"Slurm node list {text!r}: unclosed '['")
    items.append(text[start:])
    return items


def _numbers(ranges: str, where: str) -> list[str]:
    """``01-03,7`` -> ["01", "02", "03", "7"] (each range padded to its first number's width)."""
    out: list[str] = []
    for part in ranges.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ValueError(f"Slurm node list {where!r}: bad range {part!r} (want N or N-M)")
        low, high = m.group(1), m.group(2) or m.group(1)
        if int(high) < int(low):
            raise ValueError(f"Slurm node list {where!r}: range {part!r} runs backwards")
        if int(high) - int(low) >= MAX_HOSTS:
            raise ValueError(f"Slurm node list {where!r}: range {part!r} is too large")
        width = len(low)  # as hostlist.c: the first number's digits (n[08-10], n[1-010] -> n1..n10)
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


def _expand_item(item: str, where: str) -> list[str]:
    """One top-level item, e.g. ``rack[1-2]-n[01-02]`` -> the product, left group outermost."""
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    if tail and "[" not in tail:  # scontrol refuses a suffix after the last bracket group
        raise ValueError(f"Slurm node list {where!r}: {tail!r} after ']' in {item!r}")
    return [head + n + rest for n in _numbers(m.group(1), where) for rest in _expand_item(tail, where)]


def expand_nodelist(text: str) -> list[str]:
    """The host names of a Slurm host list, in order, as ``scontrol show hostnames`` prints
    them (duplicates kept, as scontrol keeps them). Raises ValueError (one line naming the
    list) for unbalanced brackets, bad ranges or names that are not host names."""
    text = text.strip()
    if not text:
        raise ValueError("Slurm node list is empty (SLURM_JOB_NODELIST)")
    names: list[str] = []
    for item in _split_top(text):
        item = item.strip()
        if not item:
            continue
        for name in _expand_item(item, text):
            if not valid_host_name(name):
                raise ValueError(f"Slurm node list {text!r}: {name!r} is not a host name")
            names.append(name)
    return names


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) -> [2, 2, 2, 1]. Raises ValueError."""
    out: list[int] = []
    for part in text.split(","):
        m = _REPEAT.match(part.strip())
        if not m:
            raise ValueError(f"SLURM_TASKS_PER_NODE {text!r}: bad item {part!r} (want N or N(xK))")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def in_allocation(environ=None) -> bool:
    """True inside a Slurm allocation (``SLURM_JOB_ID`` set, as salloc and sbatch do)."""
    environ = os.environ if environ is None else environ
    return bool(environ.get("SLURM_JOB_ID"))


def _count(environ, name: str) -> int | None:
    """A positive count from ``environ[name]`` (``4``, or ``4(x2)`` / ``gpu:4`` forms: the
    first number), None when unset or empty."""
    value = environ.get(name, "").strip()
    if not value:
        return None
    m = re.search(r"([0-9]+)", value.split(":")[-1])
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"{name}={value!r} is not a positive count")
    return int(m.group(1))


def allocation_hosts(environ=None) -> list[Host]:
    """This allocation's hosts with their slots (see the module docstring). Raises ValueError
    outside an allocation or for a malformed Slurm variable."""
    environ = os.environ if environ is None else environ
    if not in_allocation(environ):
        raise ValueError("not inside a Slurm allocation (SLURM_JOB_ID is not set)")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    names = expand_nodelist(nodelist)
    per_node = _count(environ, "SLURM_GPUS_ON_NODE") or _count(environ, "SLURM_NTASKS_PER_NODE")
    if per_node is not None:
        slots = [per_node] * len(names)
    elif environ.get("SLURM_TASKS_PER_NODE"):
        slots = expand_tasks_per_node(environ["SLURM_TASKS_PER_NODE"])
        if len(slots) != len(names):
            raise ValueError(
                f"SLURM_TASKS_PER_NODE={environ['SLURM_TASKS_PER_NODE']!r} names {len(slots)} nodes, "
                f"the node list {len(names)}"
            )
    else:
        slots = [1] * len(names)
    return [Host(name, s) for name, s in zip(names, slots)]


def describe(hosts: list[Host], environ=None) -> str:
    """One line: the job id and its hosts with slots."""
    environ = os.environ if environ is None else environ
    shown = ", ".join(f"{h.name}:{h.slots}" for h in hosts[:8]) + (
        f", ... ({len(hosts)} hosts)" if len(hosts) > 8 else ""
    )
    return f"Slurm job {environ.get('SLURM_JOB_ID')}: hosts {shown}; processes start with srun"
