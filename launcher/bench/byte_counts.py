"""The byte check of ``hpar bench --hosts emulate:H`` (launcher/bench/emulate.py): while each
strategy runs, every 0.5 s (a) each host's interface counters (the root-side end of its veth:
``rx_bytes``/``rx_packets`` there are what the host sent) and (b) the kernel's per-socket TCP
payload counters of the host (``ss -tin`` in its namespace: ``bytes_sent`` of every TCP socket
but SSH's, accumulated per socket so that closing sockets do not make the total drop). Over the
training steps after warm-up (worker 0's metric reports) these give bytes per step, set against
hpar's own accounting: every worker's and server's ``bytes_sent`` against the socket counters
(which also see traffic between processes of one host), and the part hpar addressed to another
host (``bytes_sent_remote``) against the interface bytes less 66 header bytes per packet."""

from __future__ import annotations

import bisect
import json
import os
import re
import subprocess
from dataclasses import dataclass, field

# bytes of headers per packet on an emulated host's veth: Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12
PACKET_HEADER_BYTES = 66


def socket_bytes(namespace: str) -> dict[str, int]:
    """``bytes_sent`` of every TCP socket of ``namespace`` except SSH's (port 22), by
    "local peer" address pair."""
    out = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-tinH"], capture_output=True, text=True).stdout
    sockets, key = {}, None
    for line in out.splitlines():
        if line and not line[0].isspace():
            ends = line.split()[-2:]
            key = None if any(e.rsplit(":", 1)[-1] == "22" for e in ends) else " ".join(ends)
        elif key is not None:
            m = re.search(r"\bbytes_sent:(\d+)", line)
            if m:
                sockets[key] = int(m.group(1))
    return sockets


def socket_total(last: dict[str, int], now: dict[str, int]) -> int:
    """Bytes the sockets in ``now`` sent since the reading ``last``: the growth of every socket
    seen in both, and all of a socket that is new (or restarted its count). Sockets that closed
    in between lose what they sent after ``last``; summing raw counters instead would make
    the total drop whenever a socket closes."""
    return sum(v - last[k] if k in last and v >= last[k] else v for k, v in now.items())


def read_counter(path: str) -> int:
    """The integer in ``path`` (a /sys/class/net statistics counter)."""
    with open(path) as f:
        return int(f.read())


@dataclass(frozen=True)
class Sample:
    """Counters at ``time`` (epoch s), per host (address): interface bytes sent and received,
    packets sent, and the TCP payload bytes its sockets sent since the sampling began."""

    time: float
    if_sent: dict
    if_recv: dict
    tcp_sent: dict
    if_packets: dict = field(default_factory=dict)


def _at(samples: list[Sample], t: float, field: str) -> float:
    """Sum over hosts of ``field`` linearly interpolated at time ``t``."""
    times = [s.time for s in samples]
    i = min(max(bisect.bisect_left(times, t), 1), len(samples) - 1)
    a, b = samples[i - 1], samples[i]
    va, vb = sum(getattr(a, field).values()), sum(getattr(b, field).values())
    w = (t - a.time) / (b.time - a.time) if b.time > a.time else 0.0
    return va + min(max(w, 0.0), 1.0) * (vb - va)


def byte_check(samples: list[Sample], run_dir: str, warmup: int = 2) -> dict | None:
    """Bytes per step over the steps after ``warmup`` (between worker 0's first report past
    warm-up and its last but one): ``hpar`` (bytes sent that every worker and server reported for
    those steps), ``hpar_remote`` (the part they addressed to another host), ``tcp`` (kernel
    socket counters, loopback included), ``interface`` (bytes leaving the hosts: Ethernet
    frames) and ``interface_payload`` (the same less PACKET_HEADER_BYTES per packet, i.e.
    the TCP payload, acknowledgements counting nothing), and the ratios tcp/hpar and
    interface_payload/hpar_remote. None without enough samples or reports."""
    recs = []
    try:
        for line in open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8"):
            rec = json.loads(line)
            if rec.get("kind") == "metric" and "bytes_sent" in rec and "step" in rec:
                recs.append(rec)
    except (OSError, json.JSONDecodeError):
        return None
    zero = sorted((r for r in recs if r["role"] == "worker" and r["rank"] == 0), key=lambda r: r["step"])
    past = [r for r in zero if r["step"] > warmup]
    if len(past) < 2 or len(samples) < 2:
        return None
    # the window ends at the report before the last one: right after the last step worker
    # 0 gathers the whole model, a burst the counters would otherwise smear into the window
    a, b = past[0], past[-2] if len(past) > 2 else past[-1]
    steps = b["step"] - a["step"]

    def reported(field: str) -> float:  # every process's ``field`` per step, summed over (a, b]
        total = 0.0
        for who in {(r["role"], r["rank"]) for r in recs}:
            mine = sorted((r for r in recs if (r["role"], r["rank"]) == who), key=lambda r: r["step"])
            prev = a["step"]
            for r in mine:
                if a["step"] < r["step"] <= b["step"]:
                    total += (r.get(field) or 0.0) * (r["step"] - prev)
                    prev = r["step"]
        return total / steps

    hpar, remote = reported("bytes_sent"), reported("bytes_sent_remote")
    tcp = (_at(samples, b["time"], "tcp_sent") - _at(samples, a["time"], "tcp_sent")) / steps
    iface = (_at(samples, b["time"], "if_sent") - _at(samples, a["time"], "if_sent")) / steps
    packets = (_at(samples, b["time"], "if_packets") - _at(samples, a["time"], "if_packets")) / steps
    payload = iface - PACKET_HEADER_BYTES * packets
    return {
        "steps": steps,
        "hpar_bytes_per_step": hpar,
        "hpar_remote_bytes_per_step": remote,
        "tcp_bytes_per_step": tcp,
        "interface_bytes_per_step": iface,
        "interface_payload_bytes_per_step": payload,
        "tcp_over_hpar": tcp / hpar if hpar else None,
        "interface_over_hpar_remote": payload / remote if remote else None,
    }
