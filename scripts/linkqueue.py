"""The queue behind each emulated link's rate cap (``scripts/testhosts.py up --rate R --queue Q``).

``fifo`` (the default, and what every figure in BENCHMARKS.md used unless it says otherwise):
one ``tc tbf`` per end of a host's veth, a single first-in first-out queue of 100 ms of the line.
A host's small messages (a pull request, an ACK, a collective's 8 bytes) wait behind whatever
bulk data its processes queued before them.

``fair``: closer to what a Linux host's own default queue (``fq_codel``) does: flows take turns,
and sparse ones (ACKs, requests, small messages) go first. This machine's kernel has no ``fq``,
``fq_codel`` or ``sfq``, only ``tbf``, ``htb``, ``pfifo``/``bfifo`` and the ``u32`` classifier,
so the queue is built from those: an ``htb`` class at the rate; under it one class for packets
under 1,024 bytes, served first (htb priority 0), and ``FLOWS`` classes that share the rest in
turn (htb's deficit round robin, a quantum of one frame). A TCP packet's class is bits 1-4 of
its source port XOR bits 1-4 of its destination port (a two-level u32 hash; bit 0 is left out
because Linux gives connect() even ports, so it barely varies). Flows whose ports collide share
a class, as in any stochastic fair queue. Each leaf holds 100 ms of the line.
"""

from __future__ import annotations

QUEUES = ("fifo", "fair")
FLOWS = 16  # fair: classes the flows are hashed over
SMALL_BYTES = 1024  # fair: IP packets shorter than this are served first


def burst_bytes(rate_bits: int) -> int:
    """The token bucket: one millisecond of the line, two full Ethernet frames at least. What a
    bucket holds passes at once after an idle spell, so a larger one lets short messages beat the
    rate. At 25 Mbit/s a 32 KiB bucket sent a 32 KB message in 1.1 ms where the line takes
    10.5 ms; with 3,028 bytes it took 10.3 ms, and 4 MB transfers keep their rate (2.97 against
    3.00 MB/s; BENCHMARKS.md 14). The kernel times the queue with high-resolution timers and
    splits GSO packets larger than the bucket, so a small one holds the rate."""
    return max(rate_bits // 8 // 1000, 2 * 1514)


def commands(queue: str, rate_bits: int, device: str) -> list[str]:
    """The ``tc -batch`` lines that cap ``device``'s egress at ``rate_bits`` bits/s with the
    queue ``queue`` (one of QUEUES). Raises ValueError for another queue or a rate under 8 kbit/s."""
    if queue not in QUEUES:
        raise ValueError(f"--queue: {queue!r} must be one of {', '.join(QUEUES)}")
    if rate_bits < 8000:
        raise ValueError(f"--rate: {rate_bits} bit/s is below 8kbit")
    burst = burst_bytes(rate_bits)
    if queue == "fifo":
        return [f"qdisc replace dev {device} root tbf rate {rate_bits}bit burst {burst} latency 100ms"]
    limit = max(rate_bits // 8 // 10, 2 * 1514)  # each leaf queue: 100 ms of the line
    share = f"burst {burst} cburst {burst} quantum 1514"
    lines = [
        f"qdisc replace dev {device} root handle 1: htb default {0x10 + FLOWS:x}",  # not TCP: the last class
        f"class add dev {device} parent 1: classid 1:1 htb rate {rate_bits}bit ceil {rate_bits}bit "
        f"burst {burst} cburst {burst}",
        f"class add dev {device} parent 1:1 classid 1:2 htb rate {rate_bits}bit ceil {rate_bits}bit {share} prio 0",
        f"qdisc add dev {device} parent 1:2 bfifo limit {limit}",
    ]
    for k in range(FLOWS + 1):
        lines += [
            f"class add dev {device} parent 1:1 classid 1:{0x10 + k:x} htb rate {max(rate_bits // (FLOWS + 2), 8000)}bit "
            f"ceil {rate_bits}bit {share} prio 1",
            f"qdisc add dev {device} parent 1:{0x10 + k:x} bfifo limit {limit}",
        ]
    # small packets first: the IP total length's bits from SMALL_BYTES up are zero
    assert SMALL_BYTES & (SMALL_BYTES - 1) == 0, "SMALL_BYTES must be a power of two"
    lines.append(
        f"filter add dev {device} parent 1: prio 1 protocol ip u32 match u16 0x0000 "
        f"0x{0xFFFF & ~(SMALL_BYTES - 1):04x} at 2 flowid 1:2"
    )
    # level 2: table 0x100+k holds the packets whose source port hashed to k; it hashes the
    # destination port into bucket m, whose packets go to class k XOR m
    for k in range(FLOWS):
        lines.append(f"filter add dev {device} parent 1: prio 2 handle {0x100 + k:x}: protocol ip u32 divisor {FLOWS}")
    lines.append(f"filter add dev {device} parent 1: prio 2 handle 2: protocol ip u32 divisor {FLOWS}")
    mask = (FLOWS - 1) << 1
    for k in range(FLOWS):
        for m in range(FLOWS):
            lines.append(
                f"filter add dev {device} parent 1: prio 2 protocol ip u32 ht {0x100 + k:x}:{m:x}: "
                f"match u8 0 0 flowid 1:{0x10 + (k ^ m):x}"
            )
        lines.append(
            f"filter add dev {device} parent 1: prio 2 protocol ip u32 ht 2:{k:x}: match u8 0 0 "
            f"hashkey mask 0x{mask:08x} at 20 link {0x100 + k:x}:"
        )
    # level 1, TCP only (ports at bytes 20-23 of a 20-byte IP header): the source port
    lines.append(
        f"filter add dev {device} parent 1: prio 2 protocol ip u32 ht 800:: match ip protocol 6 0xff "
        f"hashkey mask 0x{mask << 16:08x} at 20 link 2:"
    )
    return lines
