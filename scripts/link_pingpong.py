"""Time one message at a time over a link, after an idle spell: what a capped emulated link
charges a short message (BENCHMARKS.md 14, "A one-millisecond bucket on the emulated links").

Between two test hosts (``scripts/testhosts.py``; root, iproute2, openssh-server)::

    python scripts/testhosts.py up 2 --rate 25mbit --prefix lp --net 6
    ip netns exec lph1 python scripts/link_pingpong.py serve 10.77.6.3 &
    ip netns exec lph0 python scripts/link_pingpong.py send 10.77.6.3 --rate 25mbit
    python scripts/testhosts.py down --prefix lp

``send`` connects over TCP (no Nagle), and for each size in ``--sizes`` sends a message of
that many bytes after a ``--pause`` of idle time and waits for the server's one-byte reply;
it prints the median of ``--repeats`` such round trips in ms, the bytes per second it made
and what the line takes at ``--rate``. ``serve`` answers one client, then exits.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

PORT = 5555
SIZES = (4096, 16384, 32768, 65536, 131072, 1 << 20, 4 << 20)


def serve(addr: str) -> None:
    """Read messages (an 8-byte little-endian length, then that many bytes) from one client and
    answer each with one byte, until the client closes."""
    with socket.create_server((addr, PORT)) as srv:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                left = int.from_bytes(head, "little")
                while left:
                    left -= len(conn.recv(min(1 << 20, left)))
                conn.sendall(b"k")


def send(addr: str, rate_Bps: float, sizes, pause_s: float, repeats: int) -> None:
    """Print, per size, the median round trip (a message after ``pause_s`` idle, one-byte reply)."""
    with socket.create_connection((addr, PORT), timeout=60) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for size in sizes:
            times = []
            for _ in range(repeats):
                time.sleep(pause_s)
                t0 = time.perf_counter()
                conn.sendall(size.to_bytes(8, "little") + bytes(size))
                conn.recv(1)
                times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            print(f"{size:>9} B: {t * 1e3:9.2f} ms, {size / t / 1e6:7.2f} MB/s "
                  f"(line at --rate: {size / rate_Bps * 1e3:8.2f} ms)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("serve", "send"))
    ap.add_argument("addr", help="the server's address")
    ap.add_argument("--rate", default="25mbit", help="the link's cap, to print the line's time (e.g. 25mbit)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="message sizes in bytes, comma-separated")
    ap.add_argument("--pause", type=float, default=0.1, help="idle seconds before each message")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.mode == "serve":
        serve(args.addr)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from testhosts import _rate_bits   # the same rate syntax as testhosts --rate
    send(args.addr, _rate_bits(args.rate) / 8, [int(s) for s in args.sizes.split(",")], args.pause, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
