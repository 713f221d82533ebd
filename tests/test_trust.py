"""Run directories and exports, through the real CLI: hpar writes and cleans up only in folders
it made (strategies/state/trust.py), `hpar export` writes into OUT beside what is there
(strategies/state/export_files.py), a run directory others own or can write is refused, and the
workers run only the config.json the launcher wrote (strategies/job/config.py)."""

from __future__ import annotations

import hashlib
import os
import pwd
import stat
import subprocess
import sys

import pytest

from conftest import TINY, hpar_to_file, kill_left, write_script
from hpar.strategies.state.trust import MARKER

pytestmark = pytest.mark.multiprocess

LAUNCHED = "import os\nprint('rank', os.environ['RANK'])\n"  # a torchrun-style script for `hpar launch`


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def tree(path) -> dict[str, bytes]:
    """Every file under ``path`` (relative name -> content)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


def plant(folder, files: dict[str, str]) -> dict[str, bytes]:
    for name, text in files.items():
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return tree(folder)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 1-worker run of TINY with a checkpoint: (tmp folder, script, run dir)."""
    tmp = tmp_path_factory.mktemp("trained")
    script = write_script(tmp, TINY.replace('"steps": 20', '"steps": 4'))
    run_dir = tmp / "run"
    rc, out = hpar_to_file(
        tmp / "out.txt",
        "run",
        script,
        "--gpus",
        "1",
        "--strategy",
        "allreduce",
        "--checkpoint-every",
        "2",
        "--run-dir",
        str(run_dir),
        "--plain",
        "--no-eval",
    )
    assert rc == 0 and not kill_left(run_dir), out[-3000:]
    return tmp, script, run_dir


def test_a_new_run_directory_is_private_and_marked(trained):
    _, _, run_dir = trained
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    assert (run_dir / MARKER).is_file()


def test_group_readable_makes_the_run_directory_0750(tmp_path):
    script = write_script(tmp_path, LAUNCHED, "launched.py")
    run_dir = tmp_path / "shared-run"
    rc, out = hpar_to_file(
        tmp_path / "out.txt", "launch", "--gpus", "1", "--plain", "--group-readable", "--run-dir", str(run_dir), script
    )
    assert rc == 0 and not kill_left(run_dir), out[-3000:]
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o750 and (run_dir / MARKER).is_file()


def test_export_writes_into_a_folder_and_keeps_every_file_there(trained, tmp_path):
    from safetensors.torch import load_file

    _, _, run_dir = trained
    models = tmp_path / "models"
    before = plant(
        models, {"other-model.safetensors": "someone's", "notes/readme.txt": "keep me", ".tmp-abcdefgh": "x"}
    )
    for fmt, name in (
        ("safetensors", "model.safetensors"),
        ("torch", "model.pt"),
        ("safetensors", "model.safetensors"),
    ):
        rc, out = hpar_to_file(tmp_path / "e.txt", "export", str(run_dir), "--format", fmt, "--out", str(models))
        assert rc == 0, out
        assert (models / name).is_file()
    after = tree(models)
    assert {k: after[k] for k in before} == before, "an export changed a file it did not write"
    assert stat.S_IMODE(os.stat(models / "model.safetensors").st_mode) == 0o666 & ~_umask()  # not safetensors' 0600
    assert set(after) - set(before) == {"model.safetensors", "model.pt", ".hpar-export"}
    assert set(load_file(str(models / "model.safetensors"))) == {
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
        "4.weight",
        "4.bias",
    }


def test_export_refuses_to_replace_a_file_it_did_not_write_unless_forced(trained, tmp_path):
    _, _, run_dir = trained
    out_dir = tmp_path / "theirs"
    plant(out_dir, {"model.safetensors": "not hpar's"})
    rc, out = hpar_to_file(tmp_path / "e.txt", "export", str(run_dir), "--format", "safetensors", "--out", str(out_dir))
    assert rc == 2 and "exists and no hpar export wrote it" in out and "--force" in out, out
    assert (out_dir / "model.safetensors").read_text() == "not hpar's"
    rc, out = hpar_to_file(
        tmp_path / "e.txt", "export", str(run_dir), "--format", "torch", "--out", str(out_dir / "model.safetensors")
    )  # a file path in the way
    assert rc == 2 and "no hpar export wrote it" in out, out
    rc, out = hpar_to_file(
        tmp_path / "e.txt", "export", str(run_dir), "--format", "safetensors", "--out", str(out_dir), "--force"
    )
    assert rc == 0 and (out_dir / "model.safetensors").read_bytes() != b"not hpar's", out


def test_export_refuses_the_working_directory_the_run_and_their_ancestors(trained, tmp_path):
    tmp, _, run_dir = trained
    work = tmp_path / "work"
    before = plant(work, {"train.py": "print('mine')", "data/a.txt": "a"})
    run_before = tree(run_dir)
    for out_dir, cwd in ((".", work), (str(work), work), (str(run_dir), work), (str(tmp), work), ("/", work)):
        rc, out = hpar_to_file(
            tmp_path / "e.txt", "export", str(run_dir), "--format", "safetensors", "--out", out_dir, cwd=str(work)
        )
        assert rc == 2 and "--out" in out and len(out.strip().splitlines()) == 1, (out_dir, out)
    assert tree(work) == before and tree(run_dir) == run_before


def test_a_foreign_folder_as_run_dir_is_refused_and_kept(tiny_script, tmp_path):
    folder = tmp_path / "project"
    before = plant(
        folder,
        {
            "model/__init__.py": "# a package",
            "checkpoints/step-500/weights.bin": "other tool",
            "checkpoints/latest": "500",
            ".tmp-abcdefgh": "someone's temp",
            "sub/.tmp-12345678": "t",
        },
    )
    launched = write_script(tmp_path, LAUNCHED, "launched.py")
    for args in (
        ("run", tiny_script, "--gpus", "1", "--strategy", "allreduce", "--steps", "2"),
        ("launch", "--gpus", "1", launched),
    ):
        cmd = (
            args[:1] + ("--run-dir", str(folder), "--plain") + args[1:]
            if args[0] == "launch"
            else args + ("--run-dir", str(folder), "--plain")
        )
        rc, out = hpar_to_file(tmp_path / "out.txt", *cmd)
        assert rc == 2 and "holds files hpar did not write" in out and "Traceback" not in out, out[-2000:]
        assert not kill_left(folder)
    assert tree(folder) == before


def test_an_empty_folder_is_taken_and_a_resume_removes_only_hpars_temp_files(trained, tmp_path):
    tmp, _, run_dir = trained
    rc, out = hpar_to_file(tmp_path / "r0.txt", "run", "--resume", str(run_dir), "--steps", "4", "--plain")
    assert rc == 0 and "nothing to do" in out, out  # a finished run: its own line
    planted = plant(
        run_dir,
        {
            "checkpoints/.tmp-abcdefgh": "ours (a killed write)",
            "notes/.tmp-abcdefgh": "user's",
            ".tmp-keep-me": "user's",
            "checkpoints/step-2/.tmp-zzzzzzzz": "ours",
        },
    )
    rc, out = hpar_to_file(tmp_path / "r1.txt", "run", "--resume", str(run_dir), "--steps", "6", "--plain", "--no-eval")
    assert rc == 0 and not kill_left(run_dir), out[-3000:]
    left = tree(run_dir)
    assert "notes/.tmp-abcdefgh" in left and ".tmp-keep-me" in left
    assert "checkpoints/.tmp-abcdefgh" not in left and "checkpoints/step-2/.tmp-zzzzzzzz" not in left
    assert planted  # (the run's own files changed: only the planted ones are compared)
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    rc, out = hpar_to_file(
        tmp_path / "r2.txt",
        "launch",
        "--gpus",
        "1",
        "--plain",
        "--run-dir",
        str(empty),
        write_script(tmp_path, LAUNCHED, "launched.py"),
    )
    assert rc == 0 and (empty / MARKER).is_file() and (empty / "summary.json").is_file(), out[-2000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder owned by another user")
def test_a_run_directory_another_user_owns_or_others_can_write_is_refused(trained, tiny_script, tmp_path):
    _, _, run_dir = trained
    nobody = pwd.getpwnam("nobody")
    planted = tmp_path / "shared-tmp-run"  # pre-created by `nobody` in a shared temp folder, mode 0777
    planted.mkdir()
    os.chown(planted, nobody.pw_uid, nobody.pw_gid)
    os.chmod(planted, 0o777)
    rc, out = hpar_to_file(
        tmp_path / "o1.txt",
        "run",
        tiny_script,
        "--gpus",
        "1",
        "--strategy",
        "allreduce",
        "--steps",
        "2",
        "--run-dir",
        str(planted),
        "--plain",
    )
    assert rc == 2 and "owned by nobody" in out and len(out.strip().splitlines()) == 1, out[-2000:]
    assert os.listdir(planted) == [] and not kill_left(planted)
    config = run_dir / "config.json"
    os.chmod(config, 0o666)  # anyone could swap the script it names
    try:
        for args in (
            ("run", "--resume", str(run_dir), "--steps", "6"),
            ("export", str(run_dir), "--format", "torch", "--out", str(tmp_path / "m.pt")),
        ):
            rc, out = hpar_to_file(tmp_path / "o2.txt", *args)
            assert rc == 2 and f"{config} is writable by group and others" in out and f"chmod go-w {config}" in out, out
        assert not (tmp_path / "m.pt").exists()
    finally:
        os.chmod(config, 0o644)


def test_a_worker_refuses_a_config_that_is_not_the_launchers(trained, tmp_path):
    """HPAR_CONFIG_SHA256: a config.json swapped after the launcher wrote it is not run."""
    _, _, run_dir = trained
    config = run_dir / "config.json"
    good = hashlib.sha256(config.read_bytes()).hexdigest()
    env = {
        **os.environ,
        "HPAR_CONFIG": str(config),
        "HPAR_CONFIG_SHA256": "0" * 64,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }
    for module in ("hpar.workers.worker", "hpar.workers.server"):
        proc = subprocess.run(
            [sys.executable, "-m", module],
            env={**env, "HPAR_SERVER_INDEX": "0"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"{config}: changed after the launcher wrote it" in proc.stdout + proc.stderr
    from hpar.strategies.job.config import load_config

    assert load_config(str(config), good).script.endswith("job.py")


def test_run_dir_hf_is_made_as_the_rest_of_the_run_not_0700(tmp_path):
    """RUN_DIR/hf (save_pretrained through a temp folder) gets the mode os.makedirs gives the
    run's other folders (the run directory itself is what keeps others out)."""
    transformers = pytest.importorskip("transformers")
    from hpar.strategies.state.hf_save import save_pretrained_dir

    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    )
    old = os.umask(0o022)
    try:
        save_pretrained_dir(model, str(tmp_path / "hf"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "hf").st_mode) == 0o755 and (tmp_path / "hf" / "config.json").is_file()
