"""The documents cannot rot: every relative link (and image) in README.md, docs/,
BENCHMARKS.md and benchmarks/notes/ names a file that exists, and every #anchor into a
Markdown file names one of its headings (GitHub's heading ids); README.md stays short and links
every reference page in docs/; docs/run.md (launch.md, profile.md, bench.md) names every flag
of its command and no other. No network: links to other sites are not fetched."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

README_MAX_LINES = 220  # issue 49: a README a newcomer reads; the reference is in docs/

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _documents() -> list[str]:
    found = [os.path.join(REPO, "README.md"), os.path.join(REPO, "BENCHMARKS.md")]
    for pattern in ("docs/*.md", "benchmarks/notes/*.md"):
        found += sorted(glob.glob(os.path.join(REPO, pattern)))
    return [f for f in found if os.path.exists(f)]


def _anchors(path: str) -> set[str]:
    """GitHub's ids of the headings of a Markdown file: lower case, punctuation dropped,
    spaces to hyphens."""
    ids = set()
    in_code = False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        ids.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return ids


def _links(path: str) -> list[str]:
    text, out = open(path, encoding="utf-8").read(), []
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("mailto:"):
            continue
        out.append(target)
    return out


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in _documents():
        for target in _links(doc):
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(file):
                broken.append(f"{os.path.relpath(doc, REPO)}: {target} (no such file)")
            elif anchor and file.endswith(".md") and anchor not in _anchors(file):
                broken.append(f"{os.path.relpath(doc, REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_documents_are_there():
    """The link check below only means something if it sees the documents."""
    docs = _documents()
    assert os.path.join(REPO, "README.md") in docs
    assert any(os.sep + "docs" + os.sep in d for d in docs), "no docs/*.md found"


def test_readme_stays_short():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: move the detail to a page in docs/"
    )


def test_readme_links_every_docs_page():
    linked = {
        os.path.normpath(os.path.join(REPO, target.partition("#")[0]))
        for target in _links(os.path.join(REPO, "README.md"))
    }
    pages = sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
    unlinked = [os.path.relpath(p, REPO) for p in pages if os.path.normpath(p) not in linked]
    assert not unlinked, f"README.md does not link these reference pages: {unlinked}"


# A code span that names another command (`hpar profile --plan-out` in docs/run.md,
# `scripts/chaos.py --faults N`, `benchmarks/repredict.py ...`) holds that command's flags, not the page's.
OTHER_COMMAND = r"^(hpar (?!{command}\b)[a-z]+\b|python |scripts/|benchmarks/)"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _flags_named(path: str, command: str) -> set[str]:
    other = re.compile(OTHER_COMMAND.format(command=command))
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`([^`]*)`", lambda m: "" if other.match(m.group(1)) else m.group(0), text)
    return set(FLAG.findall(text))


HELP_OPTION = re.compile(r"^\s{1,4}(?:-\w, )?(--[a-z][a-z0-9-]*)", re.M)


def _help_flags(command: str) -> set[str]:
    """The options `hpar COMMAND --help` lists (one per line of its Options section)."""
    out = subprocess.run(
        [sys.executable, "-m", "hpar.launcher.cli", command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    return set(HELP_OPTION.findall(out.stdout)) - {"--help"}


@pytest.mark.parametrize(
    "page,command", [("run.md", "run"), ("launch.md", "launch"), ("profile.md", "profile"), ("bench.md", "bench")]
)
def test_a_command_page_documents_exactly_its_flags(page, command):
    """docs/run.md (and the pages of launch, profile and bench) name only flags that the
    command's --help lists, and every one of them: a flag renamed, removed or added cannot go
    unnoticed by its page."""
    named = _flags_named(os.path.join(REPO, "docs", page), command)
    have = _help_flags(command)
    assert len(have) >= 5, f"found {sorted(have)} in `hpar {command} --help`: check HELP_OPTION"
    unknown, missing = sorted(named - have), sorted(have - named)
    assert not unknown, f"docs/{page} names flags that `hpar {command} --help` does not list: {unknown}"
    assert not missing, f"docs/{page} does not document these flags of `hpar {command}`: {missing}"
