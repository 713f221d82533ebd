"""The cores' worth this machine's workers get computing at once (strategies/plan/probe_cores.py)
and how the cost model uses it (costmodel.cpu_share)."""

import os

import pytest
import torch

from hpar.strategies.plan import probe_cores
from hpar.strategies.plan.cluster import ClusterSpec
from hpar.strategies.plan.costmodel import cpu_share


def test_the_probe_reads_between_one_and_the_cores_and_leaves_the_thread_count():
    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    got = probe_cores.effective_cores(max(cores, 2), rounds=3)
    assert got is not None and 1.0 <= got <= max(cores, 2)
    assert torch.get_num_threads() == threads
    assert probe_cores.effective_cores(1) is None  # one core: nothing shared


def test_the_median_reading_is_kept_within_one_and_the_cores(monkeypatch):
    """A spell of other work spoils one reading, not the median; readings over C (a core faster
    at once than alone) or under 1 are clamped; a failed round gives None."""
    readings = iter([1.3, 0.2, 1.4, 1.35, 1.9])
    monkeypatch.setattr(probe_cores, "_round", lambda c, s, r: next(readings))
    assert probe_cores.effective_cores(2, rounds=5) == pytest.approx(1.35)
    monkeypatch.setattr(probe_cores, "_round", lambda c, s, r: 2.6)
    assert probe_cores.effective_cores(2, rounds=3) == 2.0
    monkeypatch.setattr(probe_cores, "_round", lambda c, s, r: 0.7)
    assert probe_cores.effective_cores(2, rounds=3) == 1.0
    monkeypatch.setattr(probe_cores, "_round", lambda c, s, r: None)
    assert probe_cores.effective_cores(2, rounds=3) is None


def test_workers_compute_as_slowly_as_their_share_of_the_cores_worth(monkeypatch):
    """Two workers on 2 vCPUs worth 1.25 cores compute 1.6x slower than one alone; the local
    cluster carries the measured figure, one worker is not probed."""
    two = ClusterSpec(1, (2,), 1, 1e9, 1e-4, cores_per_host=1.25)
    assert cpu_share(two) == pytest.approx(1.6)
    assert cpu_share(ClusterSpec(1, (1,), 1, 1e9, 1e-4, cores_per_host=1.25)) == 1.0
    if torch.cuda.is_available():
        pytest.skip("this machine's workers would use its GPU")
    from hpar.launcher.run.cluster_build import build_cluster

    monkeypatch.setattr(probe_cores, "effective_cores", lambda cores=None, **kw: 1.25)
    c = build_cluster(3, None, None, "1Gbps", None, None)
    assert c.cores_per_host == 1.25 and cpu_share(c) == pytest.approx(3 / 1.25)
