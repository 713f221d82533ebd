"""Mistakes a new user makes are refused before hpar spends a minute profiling, through the
real CLI: a host that does not resolve or whose SSH port is closed (launcher/hosts/reach.py),
and `--strategy pipeline` on a model that does not trace (one line naming hpar_layers(), with
none of torch.export's graph dumps). The script's data() leaves a marker when drawn, so a test
knows whether hpar got as far as the script."""

from __future__ import annotations

import socket

import pytest

from conftest import TINY, hpar_to_file, write_script

MARKED = TINY.replace("    for _ in range(10_000):", "    open(MARKER, 'w').close()\n    for _ in range(10_000):")

BRANCHY = """
import torch, torch.nn as nn
HPAR = {"steps": 4, "batch_size": 8, "lr": 0.1}
class M(nn.Module):   # the branch depends on the data: no whole-graph trace
    def __init__(self):
        super().__init__()
        self.a, self.out = nn.Linear(4, 8), nn.Linear(8, 1)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))   # repeated blocks: the tracer's cut points
    def forward(self, x):
        h = self.a(x)
        h = self.experts[0](h) if h.sum() > 0 else self.experts[1](h)
        return self.out(h)
def model(): return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(rank)
    while True:
        x = torch.randn(batch_size, 4, generator=g)
        yield x, x.sum(1, keepdim=True)
def loss(o, t): return ((o - t) ** 2).mean()
"""


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is: nobody listens there


@pytest.mark.parametrize(
    "entry,why",
    [("no-such-host.invalid slots=1", "does not resolve"), ("127.0.0.2:{port} slots=1", "cannot connect")],
    ids=["unresolvable", "closed"],
)
def test_an_unreachable_host_is_refused_before_the_script_is_touched(tmp_path, entry, why):
    marker = tmp_path / "drawn"
    script = write_script(tmp_path, f"MARKER = {str(marker)!r}\n" + MARKED)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost slots=1\n" + entry.format(port=_closed_port()) + "\n")
    rc, out = hpar_to_file(
        tmp_path / "out.txt", "run", script, "--gpus", "2", "--hosts", str(hosts), "--run-dir", str(tmp_path / "run")
    )
    assert rc == 2 and out.startswith("hpar: --hosts: ") and why in out and len(out.strip().splitlines()) == 1, out
    assert not marker.exists() and not (tmp_path / "run").exists(), "profiled or wrote before refusing"


def test_pipeline_on_a_model_that_does_not_trace_is_refused_before_profiling(tmp_path):
    script = write_script(tmp_path, BRANCHY)
    rc, out = hpar_to_file(
        tmp_path / "out.txt", "run", script, "--gpus", "2", "--strategy", "pipeline", "--run-dir", str(tmp_path / "run")
    )
    assert rc == 2 and "could not trace the model" in out and out.count("define hpar_layers()") == 1, out[-3000:]
    assert len(out.strip().splitlines()) == 1 and "torch.ops.aten" not in out, out[-3000:]
    assert "chose" not in out and not (tmp_path / "run").exists()


def test_a_plan_file_with_a_mistyped_key_is_refused_in_one_line_naming_it(tmp_path):
    """A plan file is read into the typed Plan (strategies/specs/decision.py): a key it does not
    know is a typo, named with the key it may mean, before any process starts."""
    script = write_script(tmp_path)
    plan = tmp_path / "bad.json"
    plan.write_text('{"strategy": "pipeline", "stagse": [[0, 2], [2, 5]]}')
    rc, out = hpar_to_file(
        tmp_path / "out.txt", "run", script, "--gpus", "2", "--plan", str(plan), "--run-dir", str(tmp_path / "run")
    )
    assert rc == 2 and len(out.strip().splitlines()) == 1, out
    assert out.strip() == (
        f"hpar: {plan}: unknown key 'stagse' (did you mean 'stages'?); write it with `hpar profile --plan-out`"
    ), out
    assert not (tmp_path / "run").exists()
