"""The package's import graph runs one way: no module imports (at the top or inside a
function) a module that imports it back, directly or through others, and no command module
imports another command or the CLI's entry point (helpers they share live in launcher/run/,
launcher/usage.py). Read from the source with ``ast``, so nothing is imported."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("launcher", "strategies", "workers")


def modules() -> dict[str, str]:
    """{"hpar.strategies.runtimes.dataparallel.allreduce": path} for every module of the package."""
    found = {}
    for top in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(root, f), ROOT)[:-3].replace(os.sep, ".")
                    found["hpar." + rel.removesuffix(".__init__")] = os.path.join(root, f)
    return found


def imports(path: str, known: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere in its source (``from a import b`` counts
    as ``a.b`` where that is a module, else ``a``)."""
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.add(full if full in known else node.module)
    return {m for m in out if m in known}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, set(mods)) - {m} for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    found = cycles(graph())
    assert not found, "modules that import each other (move what they share into a third): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_commands_import_no_other_command_nor_the_cli():
    g = graph()
    for mod, deps in g.items():
        if mod.startswith("hpar.launcher.commands."):
            bad = sorted(
                d for d in deps if d == "hpar.launcher.cli" or (d.startswith("hpar.launcher.commands.") and d != mod)
            )
            assert not bad, f"{mod} imports {bad}: shared helpers belong in launcher/run/ or launcher/usage.py"


def test_only_the_bench_command_imports_launcher_bench():
    """launcher/bench/ is `hpar bench`'s: the rest of the launcher (hpar run's and profile's
    cluster, their host specs: ``emulate:H`` is parsed by launcher/hosts/emulated.py) imports
    nothing from it."""
    for mod, deps in graph().items():
        if mod.startswith(("hpar.launcher.bench", "hpar.launcher.commands.bench")):
            continue
        bad = sorted(d for d in deps if d == "hpar.launcher.bench" or d.startswith("hpar.launcher.bench."))
        assert not bad, f"{mod} imports {bad}: what it needs from there belongs outside launcher/bench/"


def test_the_check_sees_a_circle():
    """The checker itself finds a planted circle (a test that cannot fail is no test)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def long_signatures(top: str = "launcher", limit: int = 10) -> list[str]:
    """Functions under ``top`` taking more than ``limit`` parameters (``self``/``cls`` and
    ``**kwargs`` not counted): flags travel as the typed trees of launcher/run/flags.py and
    launcher/bench/bench_config.BenchFlags instead."""
    out = []
    for root, _, files in os.walk(os.path.join(ROOT, top)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        a = node.args
                        names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                        n = len([x for x in names if x not in ("self", "cls")])
                        if n > limit:
                            out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({n})")
    return out


def test_no_function_takes_more_than_10_parameters():
    found = [hit for top in PACKAGES + ("tests", "scripts", "benchmarks") for hit in long_signatures(top)]
    assert not found, found


MAX_LINES = 350  # one concern per module (DEVELOPERS.md: modules of 100-350 lines)


def test_no_module_is_over_350_lines():
    long = [
        f"{os.path.relpath(p, ROOT)} ({n})"
        for p in modules().values()
        if (n := sum(1 for _ in open(p, encoding="utf-8"))) > MAX_LINES
    ]
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_the_size_checks_see_a_long_function(tmp_path):
    """The signature check finds a planted 11-parameter function (it can fail)."""
    (tmp_path / "m.py").write_text("def f(a, b, c, d, e, f, g, h, i, j, k, *rest, **kw):\n    pass\n")
    global ROOT
    saved, ROOT = ROOT, str(tmp_path.parent)
    try:
        assert long_signatures(tmp_path.name) == [f"{tmp_path.name}/m.py:1 f (11)"]
    finally:
        ROOT = saved


def test_no_two_modules_share_a_basename():
    """A traceback's file name names one module (`__init__.py` aside)."""
    seen: dict[str, list[str]] = {}
    for path in modules().values():
        name = os.path.basename(path)
        if name != "__init__.py":
            seen.setdefault(name, []).append(os.path.relpath(path, ROOT))
    shared = {n: p for n, p in seen.items() if len(p) > 1}
    assert not shared, f"module basenames used twice (rename one): {shared}"


def test_no_module_carries_a_dated_measurement():
    """Measured figures and their dates live in BENCHMARKS.md and benchmarks/notes/; a module
    says what it is for and cites its sources (a date in the code goes stale unseen)."""
    import re

    dated = [
        f"{os.path.relpath(p, ROOT)}:{i}"
        for p in modules().values()
        for i, line in enumerate(open(p, encoding="utf-8"), 1)
        if re.search(r"\b20\d\d-[01]\d-[0-3]\d\b", line)
    ]
    assert not dated, f"dates in modules (move the measurement to BENCHMARKS.md): {dated}"


MAX_DOCSTRING_LINES = 30  # what the module is for, what it owns, its sources; the reasoning lives in docs/


def long_docstrings(paths, limit: int = MAX_DOCSTRING_LINES) -> list[str]:
    """The modules among ``paths`` whose docstring runs over ``limit`` lines."""
    out = []
    for path in paths:
        doc = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read()), clean=False)
        if doc is not None and (n := len(doc.splitlines())) > limit:
            out.append(f"{os.path.relpath(path, ROOT)} ({n})")
    return out


def test_no_module_docstring_is_over_30_lines():
    """A module docstring says what the module is for, what it owns and the source of its
    algorithm; the longer explanation goes to the docs/ page of that feature, measured figures
    to BENCHMARKS.md."""
    found = long_docstrings(modules().values())
    assert not found, f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the reasoning to docs/): {found}"


def test_the_docstring_check_sees_a_long_one(tmp_path):
    """The check finds a planted 31-line docstring and passes a 30-line one (it can fail)."""
    (tmp_path / "long.py").write_text('"""' + "line\n" * 30 + 'line"""\nx = 1\n')
    (tmp_path / "short.py").write_text('"""' + "line\n" * 29 + 'line"""\n')
    found = long_docstrings([str(tmp_path / "long.py"), str(tmp_path / "short.py")])
    assert found == [f"{os.path.relpath(tmp_path / 'long.py', ROOT)} (31)"]


# strategies/ holds the flow from the user's script to a running strategy, in folders that name
# it; a folder imports only folders before it (upstream), never one after it: what a stage
# measures or decides cannot depend on how a later stage carries it out. First the two every
# stage reads: specs/ (what each strategy is, the plan's shape, the values its runtime and its
# models share) and common/ (devices, process groups, measured memory); then the flow: job/ (the
# user's script, model and optimizer, the run's config) -> state/ (files a run writes) ->
# profile/ (measure) -> plan/ (decide) -> runtimes/ (train). A runtime that an earlier stage
# must measure is reached through its spec (``profile_probe``, ``cluster_probe``).
FLOW = ("specs", "common", "job", "state", "profile", "plan", "runtimes")


def stage_of(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "strategies" and parts[2] in FLOW else None


def arrows_up_the_flow(g: dict[str, set[str]]) -> list[str]:
    """Each import from a strategies/ folder into a later folder of FLOW, and each import of
    runtimes/ from launcher/ (the launcher plans and starts processes; the runtimes run in them)."""
    out = []
    for mod, deps in g.items():
        here = stage_of(mod)
        for d in sorted(deps):
            there = stage_of(d)
            if there is None:
                continue
            if here is not None and FLOW.index(there) > FLOW.index(here):
                out.append(f"{mod} -> {d}")
            elif mod.startswith("hpar.launcher") and there == "runtimes":
                out.append(f"{mod} -> {d}")
    return out


def test_no_arrow_runs_up_the_flow():
    found = arrows_up_the_flow(graph())
    assert not found, (
        "imports against the flow (move the shared piece upstream, e.g. a rule the "
        "plan needs out of the runtime): " + "; ".join(found)
    )


def test_the_flow_check_sees_an_arrow_up():
    g = {
        "hpar.strategies.plan.a": {"hpar.strategies.runtimes.b"},
        "hpar.strategies.runtimes.b": set(),
        "hpar.launcher.c": {"hpar.strategies.runtimes.b", "hpar.strategies.plan.a"},
    }
    assert sorted(arrows_up_the_flow(g)) == [
        "hpar.launcher.c -> hpar.strategies.runtimes.b",
        "hpar.strategies.plan.a -> hpar.strategies.runtimes.b",
    ]


def test_strategies_import_neither_the_launcher_nor_the_workers():
    """Training math never reaches for hosts or processes: what it needs from them is passed in."""
    bad = [
        f"{m} -> {d}"
        for m, deps in graph().items()
        if m.startswith("hpar.strategies")
        for d in sorted(deps)
        if d.startswith(("hpar.launcher", "hpar.workers"))
    ]
    assert not bad, bad
