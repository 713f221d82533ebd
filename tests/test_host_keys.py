"""SSH host keys: an unknown host key is refused by default and recorded with --ssh-accept-new (issue 18)."""

import subprocess

import pytest

from conftest import TINY, hpar_to_file, write_script

pytestmark = [pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def one_host():
    from support import netns_hosts

    yield from netns_hosts.make_hosts(1)


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_unknown_host_keys_refused_by_default_and_recorded_with_accept_new(one_host, tmp_path):
    from hpar.launcher.hosts.hostfile import Host
    from hpar.launcher.procs.ssh import SSHError, SSHOptions, connect

    script = write_script(
        tmp_path, TINY.replace('"steps": 20', '"steps": 6').replace('"log_every": 5', '"log_every": 2')
    )
    address = one_host.addresses[0]
    known = tmp_path / "known_hosts"
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text(f"root@{address}:22 slots=2\n")
    base = (
        "run",
        script,
        "--hosts",
        str(hosts_file),
        "--gpus",
        "1",
        "--strategy",
        "allreduce",
        "--steps",
        "2",
        "--no-eval",
        "--plain",
        "--ssh-key",
        one_host.key,
        "--ssh-known-hosts",
        str(known),
    )
    # 1. not in known_hosts (here: no file at all): refused, one line naming the host and the fix
    code, out = hpar_to_file(tmp_path / "refused.txt", *base, "--run-dir", str(tmp_path / "run1"), timeout=180)
    assert code == 2, out
    line = [x for x in out.splitlines() if x.startswith("hpar: ")][-1]
    assert (
        "preflight failed" in line and address in line and "host key is not in" in line and "--ssh-accept-new" in line
    ), line
    assert not known.exists() and not (tmp_path / "run1").exists()
    # 2. --ssh-accept-new records it and the run goes ahead; the next run checks against it
    code, out = hpar_to_file(
        tmp_path / "accepted.txt", *base, "--ssh-accept-new", "--run-dir", str(tmp_path / "run2"), timeout=180
    )
    assert code == 0, out
    recorded = known.read_text().split()
    assert recorded[0] == address and recorded[1] == "ssh-ed25519"
    opts = SSHOptions(key=one_host.key, known_hosts=str(known), connect_timeout=5, retries=0)
    connect(Host(address, user="root"), opts).close()  # known now: no flag needed
    # 3. a different key on record for the host: refused even with --ssh-accept-new
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    other = (tmp_path / "other.pub").read_text().split()
    known.write_text(f"{address} {other[0]} {other[1]}\n")
    with pytest.raises(SSHError, match="host key differs"):
        connect(
            Host(address, user="root"),
            SSHOptions(key=one_host.key, known_hosts=str(known), accept_new=True, connect_timeout=5, retries=0),
        )
