"""``--strategy torchrec`` (strategies/runtimes/torchrec/) through the real CLI: TorchRec's sharded tables
train examples/recsys.py and a user's model with weighted sum bags equal to one process; ``hpar
bench`` reports it beside hybrid; what cannot run is one line before any worker starts. The runs
need the optional install (scripts/install_torchrec.sh) and skip without it; the version check
does not."""

import json
import os

import pytest

from conftest import REPO, final_state, hpar_to_file, single_process_reference, write_script

from hpar.strategies.runtimes.torchrec.trec_check import problem, versions

# the launcher's own check (package metadata: importing torchrec takes seconds); the runs then import it
MISSING = problem(versions())
HAVE_TORCHREC = MISSING is None
needs_torchrec = pytest.mark.skipif(not HAVE_TORCHREC, reason=f"{MISSING} (scripts/install_torchrec.sh)")
RECSYS = os.path.join(REPO, "examples", "recsys.py")

# A user's model: a weighted sum bag over 2-D ids (per-sample weights), a mean bag and a plain
# lookup of 2 ids per sample, called with keywords (a dict of the forward's names).
BAGS = """
import torch, torch.nn as nn
HPAR = {"steps": 4, "batch_size": 6, "lr": 0.1, "log_every": 1}
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.clicks = nn.EmbeddingBag(300, 8, mode="sum")
        self.seen = nn.EmbeddingBag(200, 8, mode="mean")
        self.user = nn.Embedding(100, 8)
        self.head = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))
    def forward(self, ids, weights, seen, users):
        u = self.user(users)
        x = torch.cat([self.clicks(ids, per_sample_weights=weights), self.seen(seen), u[:, 0], u[:, 1]], 1)
        return self.head(x).squeeze(1)
def model():
    return M()
def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(100 + rank)
    while True:
        ids = torch.randint(0, 300, (batch_size, 5), generator=g)
        x = {"ids": ids, "weights": torch.rand(batch_size, 5, generator=g),
             "seen": torch.randint(0, 200, (batch_size, 3), generator=g),
             "users": torch.randint(0, 100, (batch_size, 2), generator=g)}
        yield x, (ids % 7).float().mean(1)
def loss(output, targets):
    return ((output - targets) ** 2).mean()
def optimizer(params):
    return torch.optim.Adagrad(params, lr=0.1)
"""


def _step_losses(run_dir: str) -> dict[int, float]:
    """Step -> the workers' mean training loss of that step (metrics.jsonl, --log-every 1)."""
    by_step: dict[int, list[float]] = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        m = json.loads(line)
        if m["kind"] == "metric" and m.get("role") == "worker":
            by_step.setdefault(m["step"], []).append(m["loss"])
    return {s: sum(v) / len(v) for s, v in sorted(by_step.items())}


@needs_torchrec
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,kind", [("torchrec-rw", "row_wise"), ("torchrec-cw", "column_wise x2")])
def test_weighted_bags_equal_one_process(tmp_path, reap_run, strategy, kind):
    """A user's model with weighted sum bags, a mean bag and a lookup, its tables split by rows
    or by columns (8 columns in 2 shards of 4: the count TorchRec's plan holds, which the
    bytes counted use): every step's loss (the first: same initial tables, same batch) and the
    trained model equal one process on the concatenated batch (Adagrad, exact in TorchRec's
    fused kernel); no process left."""
    script = write_script(tmp_path, BAGS)
    run_dir = str(tmp_path / "bags")
    reap_run(run_dir)
    code, out = hpar_to_file(
        tmp_path / "bags.out", "run", script, "--strategy", strategy, "--gpus", "2", "--run-dir", run_dir, "--seed", "3"
    )
    assert code == 0, out[-3000:]
    assert f"torchrec shards clicks {kind}, seen {kind}, user {kind}" in out, out[-3000:]
    losses = []
    want_state = single_process_reference(script, 2, 4, 6, 0.1, seed=3, losses=losses)
    got = _step_losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4], got
    for step, want in enumerate(losses, 1):
        assert got[step] == pytest.approx(want, rel=1e-5), (step, got, losses)
    state = final_state(run_dir)
    assert state.keys() == want_state.keys()
    for k, want in want_state.items():
        assert (state[k] - want).abs().max().item() <= 1e-4 * max(want.abs().max().item(), 1e-6), k


@needs_torchrec
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_checkpoint_resumes_exactly_and_at_another_worker_count(tmp_path, reap_run):
    """2 steps with a checkpoint, resumed to 4: steps 3 and 4 and the trained model equal an
    uninterrupted run (the tables' shards and Adagrad's fused sums restored through DCP); then
    resumed at 1 worker: its first step's loss is the 4-step model's on that worker's batch."""
    import itertools
    from hpar.strategies.job.contract import load_job
    from hpar.strategies.job.forward import call_model

    script = write_script(tmp_path, BAGS)
    run_dir = str(tmp_path / "ck")
    reap_run(run_dir)
    code, out = hpar_to_file(
        tmp_path / "a.out",
        "run",
        script,
        "--strategy",
        "torchrec-rw",
        "--gpus",
        "2",
        "--steps",
        "2",
        "--checkpoint-every",
        "2",
        "--seed",
        "3",
        "--run-dir",
        run_dir,
    )
    assert code == 0, out[-3000:]
    code, out = hpar_to_file(tmp_path / "b.out", "run", "--resume", run_dir, "--steps", "4")
    assert code == 0 and "from its checkpoint of step 2" in out, out[-3000:]
    losses = []
    want_state = single_process_reference(script, 2, 4, 6, 0.1, seed=3, losses=losses)
    got = _step_losses(run_dir)
    assert [got[s] for s in (3, 4)] == pytest.approx(losses[2:], rel=1e-5), (got, losses)
    state = final_state(run_dir)
    for k, want in want_state.items():
        assert (state[k] - want).abs().max().item() <= 1e-4 * max(want.abs().max().item(), 1e-6), k
    code, out = hpar_to_file(tmp_path / "c.out", "run", "--resume", run_dir, "--steps", "5", "--gpus", "1")
    assert code == 0 and "as 1 worker" in out, out[-3000:]
    job = load_job(script)
    model = job.build_model()
    model.load_state_dict(want_state)
    x, y = next(itertools.islice(job.batches(0, 1, 6), 4, None))  # worker 0's 5th batch at 1 worker
    assert _step_losses(run_dir)[5] == pytest.approx(float(job.compute_loss(call_model(model, x), y)), rel=1e-5)


@needs_torchrec
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_recsys_trains_with_the_planners_shards(tmp_path, reap_run):
    """`hpar run examples/recsys.py --strategy torchrec --gpus 2`: exit 0, evaluation improves,
    bytes counted, no process left."""
    run_dir = str(tmp_path / "recsys")
    reap_run(run_dir)
    code, out = hpar_to_file(
        tmp_path / "recsys.out",
        "run",
        RECSYS,
        "--strategy",
        "torchrec",
        "--gpus",
        "2",
        "--steps",
        "20",
        "--batch-size",
        "128",
        "--run-dir",
        run_dir,
    )
    assert code == 0, out[-3000:]
    assert "torchrec shards user " in out, out[-3000:]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["strategy"] == "torchrec" and summary["world_size"] == 2
    assert summary["eval_last"]["logloss"] < summary["eval_first"]["logloss"], summary
    assert summary["bytes_per_step"]["sent"] > 0


@needs_torchrec
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_bench_reports_torchrec_beside_hybrid(tmp_path):
    """`hpar bench examples/recsys.py --gpus 2 --strategies hybrid,torchrec`: both rows ran."""
    out_json = tmp_path / "bench.json"
    code, out = hpar_to_file(
        tmp_path / "bench.out",
        "bench",
        RECSYS,
        "--gpus",
        "2",
        "--strategies",
        "hybrid,torchrec",
        "--steps",
        "6",
        "--batch-size",
        "128",
        "--json",
        str(out_json),
        "--bench-dir",
        str(tmp_path / "b"),
        timeout=380,
    )
    assert code == 0, out[-3000:]
    rows = [line for line in out.splitlines() if line.lstrip("│| ").startswith(("hybrid", "torchrec"))]
    assert {r.lstrip("│| ").split()[0] for r in rows} >= {"hybrid", "torchrec"}, out[-3000:]
    text = out_json.read_text()
    assert '"torchrec"' in text and '"hybrid"' in text


def _fake_install(tmp_path, torchrec_version: str) -> dict:
    """PYTHONPATH with a ``torchrec-<version>.dist-info`` ahead of site-packages: what the
    metadata of a mismatched install says (the registry's plugin test uses the same device)."""
    site = tmp_path / "site"
    info = site / f"torchrec-{torchrec_version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchrec\nVersion: {torchrec_version}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def test_what_cannot_run_is_one_line(tmp_path, reap_run):
    """Before any worker: a torchrec that does not match torch names the versions and the
    install script; fp16 and an optimizer TorchRec cannot fuse are one line each; exit 2."""
    script = write_script(tmp_path, BAGS)
    run_dir = str(tmp_path / "r")
    reap_run(run_dir)
    code, out = hpar_to_file(
        tmp_path / "v.out",
        "run",
        script,
        "--strategy",
        "torchrec",
        "--gpus",
        "2",
        "--run-dir",
        run_dir,
        env=_fake_install(tmp_path, "1.5.0"),
    )
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, out
    assert "torchrec 1.5.0" in lines[0] and "install_torchrec.sh" in lines[0] and "Traceback" not in out
    code, out = hpar_to_file(
        tmp_path / "p.out", "run", script, "--strategy", "torchrec", "--precision", "fp16", "--run-dir", run_dir
    )
    assert code == 2 and "--precision fp16" in out and "Traceback" not in out, out
    if HAVE_TORCHREC:  # the model checks come after the install check
        momentum = write_script(
            tmp_path, BAGS.replace("Adagrad(params, lr=0.1)", "SGD(params, lr=0.1, momentum=0.9)"), name="momentum.py"
        )
        code, out = hpar_to_file(tmp_path / "m.out", "run", momentum, "--strategy", "torchrec", "--run-dir", run_dir)
        assert code == 2 and "SGD with momentum" in out and "Traceback" not in out, out
    assert not os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
