"""The user-script contract: loading, checking, and the one-line errors for bad scripts."""

import pytest
import torch

from hpar.strategies.job.contract import JobError, check_job, load_job

from conftest import TINY, hpar, write_script


def test_loads_tiny_script_and_defaults(tmp_path):
    job = load_job(write_script(tmp_path))
    assert job.defaults == {"steps": 20, "batch_size": 8, "lr": 0.1, "log_every": 5}
    check_job(job, 8)
    inputs, targets = next(job.batches(0, 2, 8))
    assert inputs.shape == (8, 4) and targets.shape == (8, 1)
    opt = job.build_optimizer(job.build_model().parameters(), lr=0.5)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 0.5
    assert set(job.run_evaluate(job.build_model())) == {"mse"}


def test_default_optimizer_is_sgd(tmp_path):
    job = load_job(write_script(tmp_path, TINY.replace("def optimizer(params):", "def _unused(params):")))
    assert job.optimizer_fn is None
    opt = job.build_optimizer(job.build_model().parameters(), lr=0.3)
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["lr"] == 0.3


def test_batches_restart_after_an_epoch(tmp_path):
    text = TINY.replace("range(10_000)", "range(2)")
    job = load_job(write_script(tmp_path, text))
    it = job.batches(0, 1, 4)
    first = [next(it)[0] for _ in range(4)]
    assert torch.equal(first[0], first[2]) and not torch.equal(first[0], first[1])


BAD = [
    ("missing model", TINY.replace("def model():", "def modell():"), "missing function model()"),
    ("missing data", TINY.replace("def data(", "def dat("), "missing function data()"),
    ("missing loss", TINY.replace("def loss(", "def los("), "missing function loss()"),
    ("syntax error", TINY + "\ndef broken(:\n", "syntax error"),
    (
        "import raises",
        "raise RuntimeError('boom at import')\n" + TINY,
        "importing the script raised RuntimeError: boom at import",
    ),
    ("model not a function", TINY + "\nmodel = 3\n", "model is a int, expected a function"),
    (
        "data wrong arity",
        TINY.replace("def data(rank, world_size, batch_size):", "def data(rank):"),
        "data() must take 3",
    ),
    (
        "model returns wrong type",
        TINY.replace("return nn.Sequential(", "return 5 or nn.Sequential("),
        "model() returned int",
    ),
    ("data yields non-pair", TINY.replace("yield x, x.sum(1, keepdim=True)", "yield x"), "data() yielded Tensor"),
    ("data empty", TINY.replace("range(10_000)", "range(0)"), "yielded no batch"),
    (
        "loss not scalar",
        TINY.replace("return ((output - targets) ** 2).mean()", "return (output - targets) ** 2"),
        "loss() returned Tensor",
    ),
    (
        "loss raises",
        TINY.replace("return ((output - targets) ** 2).mean()", "raise KeyError('oops')"),
        "loss() raised KeyError",
    ),
    (
        "optimizer wrong type",
        TINY.replace("return torch.optim.SGD(params, lr=0.1, momentum=0.9)", "return 1"),
        "optimizer() returned int",
    ),
    (
        "HPAR not a dict",
        TINY.replace('HPAR = {"steps": 20', 'HPAR = [{"steps": 20').replace('"log_every": 5}', '"log_every": 5}]'),
        "HPAR is a list",
    ),
    ("HPAR unknown key", TINY.replace('"log_every": 5}', '"log_every": 5, "epochs": 3}'), "unknown key 'epochs'"),
    ("HPAR wrong type", TINY.replace('"steps": 20', '"steps": "20"'), "HPAR['steps']"),
]


@pytest.mark.parametrize("name,text,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_script_is_one_line_error(tmp_path, name, text, expected):
    path = write_script(tmp_path, text)
    with pytest.raises(JobError) as err:
        check_job(load_job(path), 8)
    message = str(err.value)
    assert expected in message and path in message and "\n" not in message


def test_missing_file(tmp_path):
    with pytest.raises(JobError, match="no such file"):
        load_job(str(tmp_path / "nope.py"))


def test_syntax_error_names_the_line(tmp_path):
    path = write_script(tmp_path, "x = 1\ndef f(:\n")
    with pytest.raises(JobError, match=r":2: syntax error"):
        load_job(path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name,text,expected",
    [BAD[0], BAD[3], BAD[4], BAD[7], BAD[11]],
    ids=["missing", "syntax", "import", "type", "raises"],
)
def test_cli_exits_2_and_starts_nothing(tmp_path, name, text, expected):
    path = write_script(tmp_path, text)
    run_dir = tmp_path / "run"
    res = hpar("run", path, "--gpus", "2", "--run-dir", str(run_dir), "--strategy", "allreduce")
    assert res.returncode == 2, res.stderr
    first = res.stderr.strip().splitlines()[0]
    assert first.startswith("hpar: ") and path in first and expected in first
    assert not run_dir.exists(), "no run directory (and so no process) for a bad script"
    if name in ("import", "raises"):
        assert "Traceback" in res.stderr  # the user's own traceback follows the one-line message


def test_evaluate_gets_the_model_in_eval_mode_without_grad_and_train_mode_comes_back(tmp_path):
    """docs/contract.md: evaluate(model) runs in eval mode under no_grad; the model is back in
    train mode afterwards, also when evaluate() raised."""
    script = write_script(
        tmp_path,
        TINY
        + """
seen = []
def evaluate(model):
    import torch
    seen.append((model.training, torch.is_grad_enabled()))
    if len(seen) > 1:
        raise RuntimeError("broken metric")
    return {"n": 1.0}
""",
    )
    job = load_job(script)
    model = job.build_model()
    assert job.run_evaluate(model) == {"n": 1.0} and model.training
    with pytest.raises(Exception):
        job.run_evaluate(model)
    assert model.training and job.evaluate_fn.__globals__["seen"] == [(False, False), (False, False)]
