"""Every shell command in README.md and docs/*.md that is marked runnable runs as written
(issue 65, "docs that match"): each one as a real `hpar` subprocess, in a fresh working
directory per page, after the install its page names, shortened as marked; it must exit 0,
leave the result it promises (a finished run, a written file, ...) and no process behind.

The convention (for whoever writes the documents; it is not user documentation):

- An HTML comment alone on the line directly before a fenced shell block (```bash) marks that
  block runnable. GitHub does not render the comment, so a reader sees the plain block:

      <!-- runnable -->                 the commands are quick as written
      <!-- runnable: --steps 4 -->      these words are appended to every `hpar run` of the block

  The words after `runnable:` shorten a training run (later flags win, so `--steps 4` overrides
  the script's own 200); they are appended to `hpar run` commands only (`hpar launch` passes its
  trailing words to the script, `hpar profile` trains nothing).
- Each line of the block is one command (`\\` continues a line; `# ...` comments are dropped);
  `&&` chains commands. `pip install ...` is the page's install, which the suite runs after, so
  it is not run again; every other command must be an `hpar` command.
- `runs/RUN` in a command stands for the run directory of the last `hpar run` or `hpar launch`
  the test ran on the same page (the docs say so where they use it); a page that uses it before
  any run fails.
- The commands run in a temporary directory in which `examples/` is the repository's (README
  says to run them from the repository root); `runs/` and any file they write land there.
- A script that needs an optional extra (scikit-learn for examples/cnn.py and
  examples/ddp_digits.py, transformers for examples/hf_gpt2.py: the package's own metadata says
  which extra brings each) may be run only on a page that names `pip install -e '.[EXTRA]'`.

Left unmarked, and why (this machine has 2 CPU cores, no GPU, no network, no hosts of its own):
commands that need real hosts (`--hosts hosts.txt`, SSH), a Slurm allocation (`salloc`,
`sbatch`), a GPU (`--device cuda`), or root-made emulated hosts (`hpar bench --hosts emulate:H`,
`--scale`, scripts/testhosts.py); synopses with placeholders (`hpar run SCRIPT --gpus N ...`);
output shown as an example (`$ hpar run ...` followed by its lines); the test suite itself
(`python -m pytest`), and scripts/ and benchmarks/ tools that need a bench's results or run for
many minutes (scripts/chaos.py, benchmarks/bench_markdown.py).
"""

from __future__ import annotations

import ast
import glob
import importlib.metadata
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field

import pytest

from conftest import REPO, hpar_to_file, kill_left

MARK = re.compile(r"^<!--\s*runnable(?::(?P<args>[^>]*?))?\s*-->$")
SHELL_FENCE = re.compile(r"^```(?:bash|sh|shell)\s*$")
PLACEHOLDER = "runs/RUN"
COMMAND_TIMEOUT = 300  # seconds for one command; a shortened run takes 20-90 s on a busy 2-core machine


@dataclass
class Command:
    """One command of a marked block: where it stands, its words, and what its mark appends."""

    page: str
    line: int
    words: list[str]
    extra: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.words)}"


def pages() -> list[str]:
    """README.md and docs/*.md, relative to the repository root."""
    found = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
    return [p for p in found if os.path.exists(os.path.join(REPO, p))]


def _split_chain(words: list[str], where: str) -> list[list[str]]:
    """The commands of one line, split at `&&`; other shell operators are refused."""
    for word in words:
        if word in ("|", "||", ";", "&", ">", ">>", "<") or word.endswith(";"):
            raise ValueError(f"{where}: `{word}`: a runnable block holds plain commands, chained with && only")
    chain, current = [], []
    for word in words + ["&&"]:
        if word == "&&":
            if current:
                chain.append(current)
            current = []
        else:
            current.append(word)
    return chain


def marked_commands(page: str, root: str = REPO) -> list[Command]:
    """The commands of the blocks marked runnable on ``page`` (README.md or docs/X.md, under
    ``root``), in page order, without the page's `pip install` steps. Raises ValueError for a
    mark that does not stand directly before a shell block, or a command the test cannot run."""
    with open(os.path.join(root, page), encoding="utf-8") as f:
        lines = f.read().splitlines()
    commands: list[Command] = []
    for i, line in enumerate(lines):
        if not re.match(r"<!--\s*run", line.strip(), re.I):
            continue
        mark = MARK.match(line.strip())
        if mark is None:
            raise ValueError(f"{page}:{i + 1}: not a runnable mark: {line.strip()!r} (see tests/test_docs_commands.py)")
        if i + 1 >= len(lines) or not SHELL_FENCE.match(lines[i + 1]):
            raise ValueError(f"{page}:{i + 1}: a runnable mark must stand directly before a ```bash block")
        extra = shlex.split(mark.group("args") or "")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{page}:{i + 2}: the marked block never ends")
        number, pending = i + 3, ""
        for j in range(i + 2, end):
            if not pending:
                number = j + 1
            if lines[j].rstrip().endswith("\\"):
                pending += lines[j].rstrip()[:-1] + " "
                continue
            text, pending = pending + lines[j], ""
            where = f"{page}:{number}"
            for words in _split_chain(shlex.split(text, comments=True), where):
                if words[:2] == ["pip", "install"]:
                    continue
                if words[0] != "hpar" or len(words) < 2:
                    raise ValueError(f"{where}: `{shlex.join(words)}`: the test runs `hpar` commands only")
                commands.append(Command(page, number, words, extra if words[1] == "run" else []))
        if not any(c.line > i for c in commands):
            raise ValueError(f"{page}:{i + 1}: the marked block holds no command to run")
    return commands


def marked_pages() -> list[str]:
    """The pages with at least one runnable block."""
    return [p for p in pages() if marked_commands(p)]


def test_every_mark_stands_before_a_shell_block_of_hpar_commands():
    """Parsing every page raises nothing (a misspelt or misplaced mark, a block that is not
    shell, an operator the test does not run), and the marks are found where they are known to
    be: an extraction that found nothing would leave the page test below with no cases."""
    found = {page: marked_commands(page) for page in pages()}
    assert "README.md" in found and len(found) >= 10, f"pages found: {sorted(found)}"
    for page in ("README.md", "docs/launch.md", "docs/state.md"):
        assert found[page], f"{page}: no runnable block found (its marks are documented in this file)"
    readme = found["README.md"]
    assert readme[0].words[:3] == ["hpar", "run", "examples/lm.py"] and readme[0].extra, (
        f"README's first command is not the marked, shortened lm.py run: {readme[0]}"
    )


def test_the_parser_splits_chains_and_refuses_other_operators(tmp_path):
    """`&&` chains are split and `pip install` steps dropped; a pipe, a misspelt mark, a mark
    away from its block and a non-hpar command are refused with the page and line."""
    page = tmp_path / "p.md"
    page.write_text(
        "<!-- runnable: --steps 2 -->\n```bash\npip install -e . && hpar run a.py --gpus 2"
        "   # note\nhpar export runs/RUN \\\n  --out m.pt\n```\n"
    )
    got = [(c.line, c.words, c.extra) for c in marked_commands("p.md", str(tmp_path))]
    assert got == [
        (3, ["hpar", "run", "a.py", "--gpus", "2"], ["--steps", "2"]),
        (4, ["hpar", "export", "runs/RUN", "--out", "m.pt"], []),
    ], got
    for text, says in [
        ("<!-- runnable -->\n```bash\nhpar runs | head\n```\n", "p.md:3: `|`"),
        ("<!-- runable -->\n```bash\nhpar runs\n```\n", "p.md:1: not a runnable mark"),
        ("<!-- runnable -->\n\n```bash\nhpar runs\n```\n", "p.md:1: a runnable mark must"),
        ("<!-- runnable -->\n```python\nimport torch\n```\n", "p.md:1: a runnable mark must"),
        ("<!-- runnable -->\n```bash\nls runs\n```\n", "p.md:3: `ls runs`"),
    ]:
        page.write_text(text)
        with pytest.raises(ValueError, match=re.escape(says)):
            marked_commands("p.md", str(tmp_path))


# ---- the install a page names ----------------------------------------------------------------


def _third_party_imports(script: str, seen: set[str] | None = None) -> set[str]:
    """Top-level modules ``script`` imports (anywhere in it, and in the examples/ modules it
    imports) that are neither the standard library, torch, nor a file beside it."""
    seen = set() if seen is None else seen
    if script in seen:
        return set()
    seen.add(script)
    with open(script, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found: set[str] = set()
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
            else []
        )
        for name in names:
            top = name.split(".")[0]
            beside = os.path.join(os.path.dirname(script), top + ".py")
            if os.path.exists(beside):
                found |= _third_party_imports(beside, seen)
            elif top not in sys.stdlib_module_names and top != "torch":
                found.add(top)
    return found


def _extras_of(module: str) -> set[str]:
    """The extras of the installed hpar package (its metadata, as pip installed it) that bring
    the distribution providing ``module``; empty when hpar requires it in any case."""
    dists = importlib.metadata.packages_distributions().get(module, [module])
    extras: set[str] = set()
    for req in importlib.metadata.requires("hpar") or []:
        name = re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower()
        if name not in {d.lower() for d in dists}:
            continue
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", req)
        if extra is None:
            return set()
        extras.add(extra.group(1))
    return extras - {"dev"}


def test_a_marked_script_that_needs_an_extra_is_on_a_page_naming_that_install():
    """examples/cnn.py and ddp_digits.py need scikit-learn, hf_gpt2.py transformers: a page that
    runs one names `pip install -e '.[EXTRA]'` for an extra that brings it."""
    assert _extras_of("sklearn") == {"examples"} and "hf" in _extras_of("transformers"), (
        "hpar's metadata does not map scikit-learn/transformers to their extras: reinstall (pip install -e .)"
    )
    missing, checked = [], 0
    for page in marked_pages():
        with open(os.path.join(REPO, page), encoding="utf-8") as f:
            text = f.read()
        for command in marked_commands(page):
            for word in command.words:
                if not (word.startswith("examples/") and word.endswith(".py")):
                    continue
                checked += 1
                for module in sorted(_third_party_imports(os.path.join(REPO, word))):
                    extras = _extras_of(module)
                    if extras and not any(
                        f"pip install -e '.[{e}]'" in text or f'pip install -e ".[{e}]"' in text for e in extras
                    ):
                        missing.append(
                            f"{command}: {word} imports {module}, which needs "
                            f"pip install -e '.[{sorted(extras)[0]}]'; the page does not name it"
                        )
    assert checked >= 3, f"only {checked} example scripts found in the marked commands"
    assert not missing, "\n".join(missing)


# ---- running them ---------------------------------------------------------------------------


def _run_dirs(cwd: str) -> list[str]:
    """Every run directory under cwd/runs (one that holds a config.json), one level down too
    (a bench's runs)."""
    return sorted(
        os.path.dirname(p)
        for pattern in ("runs/*/config.json", "runs/*/*/config.json")
        for p in glob.glob(os.path.join(cwd, pattern))
    )


def _listing(cwd: str) -> set[str]:
    runs = os.path.join(cwd, "runs")
    return set(os.listdir(runs)) if os.path.isdir(runs) else set()


def _flag(words: list[str], name: str) -> str | None:
    """The value of the last ``name VALUE`` or ``name=VALUE`` in ``words``."""
    value = None
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith(name + "="):
            value = word.split("=", 1)[1]
    return value


def _check_result(command: Command, words: list[str], out: str, cwd: str, new: list[str], last_run: str | None):
    """What each command promises beyond exit code 0, checked on what it left in ``cwd``."""
    sub = words[1]
    if sub in ("run", "launch"):
        assert len(new) == 1, f"{command}: expected one new run directory under runs/, found {new}\n{out[-3000:]}"
        with open(os.path.join(cwd, "runs", new[0], "summary.json")) as f:
            summary = json.load(f)
        assert summary["exit_code"] == 0, f"{command}: summary.json says exit code {summary['exit_code']}"
        if sub == "run":
            assert re.search(r"^hpar: done: .* run dir .*" + re.escape(new[0]), out, re.M), (
                f"{command}: no `hpar: done: ... run dir` line naming {new[0]}\n{out[-3000:]}"
            )
            steps = _flag(words, "--steps")
            if steps is not None:
                assert summary["steps"] == int(steps), f"{command}: summary.json says {summary['steps']} steps"
    elif sub == "profile":
        assert re.search(r"^Plan: \S+", out, re.M) and "profiled in" in out, (
            f"{command}: no `Plan:` and `profiled in` lines\n{out[-3000:]}"
        )
    elif sub == "export":
        target = os.path.join(cwd, _flag(words, "--out"))
        fmt = _flag(words, "--format") or "torch"
        assert fmt == "torch", f"{command}: the test checks --format torch exports only; add a check for {fmt}"
        if os.path.isdir(target):
            target = os.path.join(target, "model.pt")
        assert re.search(r"^hpar: wrote ", out, re.M), f"{command}: no `hpar: wrote` line\n{out[-3000:]}"
        _check_exported_model(command, target, last_run)
    elif sub == "runs":
        directory = words[2] if len(words) > 2 else "runs"
        listed = re.findall(r"^(\S+)  ", out, re.M)
        names = os.listdir(os.path.join(cwd, directory)) if os.path.isdir(os.path.join(cwd, directory)) else []
        marked = sorted(
            os.path.join(directory, n) for n in names if os.path.exists(os.path.join(cwd, directory, n, ".hpar-run"))
        )
        assert marked and sorted(listed) == marked, f"{command}: lists {listed}, {directory} holds {marked}\n{out}"
    elif sub == "clean":
        named = [w for w in words[2:] if not w.startswith("-")]
        assert named and all(not os.path.exists(os.path.join(cwd, w)) for w in named), f"{command}: {named} still there"
        assert re.search(rf"^hpar: removed {len(named)} run director", out, re.M), out
    else:
        raise AssertionError(f"{command}: no result check for `hpar {sub}`: add one to _check_result")


def _check_exported_model(command: Command, path: str, run_dir: str):
    """docs/state.md's own use of the file: the run's script's model() loads it, strictly."""
    import torch
    from hpar.strategies.job.contract import load_job

    assert os.path.isfile(path), f"{command}: {path} was not written"
    with open(os.path.join(run_dir, "config.json")) as f:
        script = json.load(f)["script"]
    model = load_job(script).build_model()
    saved = torch.load(path, weights_only=True)
    assert saved and all(isinstance(v, torch.Tensor) for v in saved.values()), f"{command}: {path}: {type(saved)}"
    model.load_state_dict(saved)  # raises on a missing or unexpected key, or a wrong shape


def run_page(commands: list[Command], tmp_path) -> None:
    """Run ``commands`` (one page's, in order) as subprocesses in a fresh directory under
    ``tmp_path`` holding the repository's examples/; fails on the first command that exits
    non-zero, lacks its result (_check_result) or leaves a process of any run behind."""
    cwd = str(tmp_path / "work")
    os.makedirs(cwd)
    os.symlink(os.path.join(REPO, "examples"), os.path.join(cwd, "examples"))
    last_run = None
    for n, command in enumerate(commands):
        words = list(command.words) + command.extra
        if PLACEHOLDER in words:
            assert last_run is not None, f"{command}: {PLACEHOLDER} before any `hpar run` or `hpar launch` on the page"
            words = [os.path.relpath(last_run, cwd) if w == PLACEHOLDER else w for w in words]
        before = _listing(cwd)
        code, out = hpar_to_file(str(tmp_path / f"command-{n}.log"), *words[1:], cwd=cwd, timeout=COMMAND_TIMEOUT)
        new = sorted(_listing(cwd) - before)
        left = [p for d in _run_dirs(cwd) for p in kill_left(d)]
        assert code == 0, f"{command}\nran `{shlex.join(words)}`: exit code {code}\n{out[-4000:]}"
        assert not left, f"{command}: processes left behind: {[p.pid for p in left]}"
        _check_result(command, words, out, cwd, new, last_run)
        if words[1] in ("run", "launch"):
            last_run = os.path.join(cwd, "runs", new[0])


def test_a_failing_command_fails_its_page(tmp_path):
    """The page test can fail: a command that exits 2 (a script that is not there), `runs/RUN`
    before any run, and a listing of no run each fail with the page and line."""

    def page(*lines):
        return [Command("p.md", i + 1, shlex.split(line)) for i, line in enumerate(lines)]

    cases = [
        (page("hpar profile examples/missing.py --gpus 2"), "p.md:1: hpar profile examples/missing.py"),
        (page("hpar export runs/RUN --out m.pt"), "p.md:1: hpar export runs/RUN --out m.pt: runs/RUN before"),
        (page("hpar runs ."), "p.md:1: hpar runs .: lists [], . holds []"),
    ]
    for i, (commands, says) in enumerate(cases):
        with pytest.raises(AssertionError, match=re.escape(says)):
            run_page(commands, tmp_path / str(i))


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", marked_pages())
def test_the_marked_commands_of_a_page_run_as_written(page, tmp_path):
    """Each marked command of ``page``, in order, as a subprocess in a fresh directory holding
    the repository's examples/: exit code 0, its result, and no process of any run left behind
    (run_page)."""
    run_page(marked_commands(page), tmp_path)
