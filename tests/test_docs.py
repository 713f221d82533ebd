"""The documents' links cannot rot: every relative link (and image) in README.md, docs/,
BENCHMARKS.md and benchmarks/notes/ names a file that exists, and every #anchor into a
Markdown file names one of its headings (GitHub's heading ids). No network: links to other
sites are not fetched."""
from __future__ import annotations

import glob
import os
import re

from conftest import REPO

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
    text = re.sub(r"```.*?```", "", text, flags=re.S)   # code blocks hold no links
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
