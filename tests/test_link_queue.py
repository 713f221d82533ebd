"""The emulated links' queues (scripts/linkqueue.py): the tc lines of each, and a fair queue on
two real test hosts, where a TCP transfer's data and its ACKs land in the classes meant for them."""

import os
import subprocess
import sys
import time

import pytest

from support import netns_hosts

sys.path.insert(0, os.path.join(netns_hosts.ROOT, "scripts"))
import linkqueue  # noqa: E402


def test_fifo_is_one_tbf_with_a_millisecond_bucket():
    assert linkqueue.commands("fifo", 25_000_000, "eth0") == [
        "qdisc replace dev eth0 root tbf rate 25000000bit burst 3125 latency 100ms"
    ]
    assert linkqueue.burst_bytes(1_000_000) == 2 * 1514  # two frames at least


def test_fair_hashes_every_port_pair_onto_the_flow_classes():
    lines = linkqueue.commands("fair", 25_000_000, "eth0")
    leaves = [ln for ln in lines if ln.startswith("qdisc add") and "bfifo limit 312500" in ln]
    assert len(leaves) == linkqueue.FLOWS + 2  # small packets, the flows, everything not TCP
    buckets = [ln for ln in lines if " ht 1" in ln and "flowid" in ln]
    assert len(buckets) == linkqueue.FLOWS**2
    targets = [ln.rsplit("flowid 1:", 1)[1] for ln in buckets]
    for k in range(linkqueue.FLOWS):  # each source-port bucket spreads over every class
        assert sorted(targets[k * linkqueue.FLOWS : (k + 1) * linkqueue.FLOWS]) == sorted(
            f"{0x10 + c:x}" for c in range(linkqueue.FLOWS)
        )
    assert sum("match u16 0x0000 0xfc00 at 2 flowid 1:2" in ln for ln in lines) == 1  # under 1,024 bytes first


@pytest.mark.parametrize(
    "queue, rate, message",
    [
        ("sfq", 25_000_000, "--queue: 'sfq' must be one of fifo, fair"),
        ("fair", 4000, "below 8kbit"),
    ],
)
def test_a_bad_queue_or_rate_is_named(queue, rate, message):
    with pytest.raises(ValueError, match=message):
        linkqueue.commands(queue, rate, "eth0")


RECEIVER = (
    "import socket; s = socket.socket(); s.bind(('{addr}', 5001)); s.listen(1); c, _ = s.accept(); n = 0\n"
    "while True:\n    b = c.recv(65536)\n    n += len(b)\n    if not b: break\nprint(n)"
)
SENDER = "import socket; s = socket.create_connection(('{addr}', 5001)); s.sendall(bytes(300_000)); s.close()"


def _class_bytes(namespace: str) -> dict[str, int]:
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", "-s", "class", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("class htb ")[1:]
    return {c.split()[0]: int(c.split("Sent ")[1].split()[0]) for c in out}


@pytest.fixture(scope="module")
def fair_hosts():
    yield from netns_hosts.make_hosts(2, rate="25mbit", queue="fair")


def test_a_transfer_over_a_fair_queue_arrives_with_its_acks_served_first(fair_hosts):
    """300 KB from host 0 to host 1 at 25 Mbit/s: all of it arrives; on host 0 the data went to
    one flow class, on host 1 the ACKs (small packets) to the class served first."""
    (h0, h1), addr = fair_hosts.hosts, fair_hosts.hosts[1].address
    before0, before1 = _class_bytes(h0.namespace), _class_bytes(h1.namespace)
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", h1.namespace, sys.executable, "-c", RECEIVER.format(addr=addr)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(100):  # until it listens
            if subprocess.run(
                ["ip", "netns", "exec", h1.namespace, "ss", "-ltn", "sport = :5001"], capture_output=True, text=True
            ).stdout.count("LISTEN"):
                break
            time.sleep(0.05)
        subprocess.run(
            ["ip", "netns", "exec", h0.namespace, sys.executable, "-c", SENDER.format(addr=addr)],
            check=True,
            timeout=60,
        )
        assert receiver.communicate(timeout=60)[0].strip() == "300000"
    finally:
        receiver.kill()
        receiver.wait()
    sent0 = {c: n - before0.get(c, 0) for c, n in _class_bytes(h0.namespace).items()}
    sent1 = {c: n - before1.get(c, 0) for c, n in _class_bytes(h1.namespace).items()}
    flows = {c: n for c, n in sent0.items() if c not in ("1:1", "1:2")}
    assert max(flows.values()) > 300_000  # the data, headers included, in one flow class
    assert sent1["1:2"] > 0 and sum(n for c, n in sent1.items() if c not in ("1:1", "1:2")) < 1000  # ACKs go first
