"""``--hosts emulate:H``, the host spec of an emulated cluster on this machine: its host count,
and the workers each host gets. Parsing only; building and removing the hosts is
launcher/bench/emulate.py's (``hpar bench``), which ``hpar profile`` and ``hpar run`` never need."""

from __future__ import annotations

import math


def parse_emulate(hosts: str | None) -> int | None:
    """H for ``emulate:H`` (None for any other --hosts). Raises ValueError for a bad H."""
    if not hosts or not hosts.startswith("emulate:"):
        return None
    text = hosts.split(":", 1)[1]
    if not text.isdigit() or not 1 <= int(text) <= 32:
        raise ValueError(f"--hosts {hosts}: write emulate:H with H hosts, 1..32 (e.g. emulate:2)")
    return int(text)


def slots_per_host(hosts: int, gpus: int) -> int:
    """Workers on each of ``hosts`` emulated hosts for ``gpus`` workers: ceil(gpus / hosts).
    Raises ValueError when some host would have none."""
    if gpus < hosts:
        raise ValueError(f"--hosts emulate:{hosts} with --gpus {gpus}: give at least one GPU per host")
    return math.ceil(gpus / hosts)
