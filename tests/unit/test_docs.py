"""The docs point only at what exists: every relative link's file and heading, every file path they name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "SECURITY.md", REPO / "benchmarks" / "README.md",
        *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a path in backticks that names a file of ours: docs, sources, tests, examples, benchmarks
NAMED_PATH = re.compile(r"`((?:docs|src|tests|examples|benchmarks)/[\w./-]+\.(?:md|py|png|yaml|toml)|[A-Z]+\.md)`")


def anchors(markdown: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", markdown.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def relative_links(markdown: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown.read_text(encoding="utf-8"), flags=re.S)  # code is not links
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


@pytest.mark.parametrize("markdown", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_its_heading_exist(markdown):
    for link in relative_links(markdown):
        path, _, anchor = link.partition("#")
        target = (markdown.parent / path).resolve() if path else markdown
        assert target.exists(), f"{markdown.name} links to {link!r}: no such file"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), f"{markdown.name} links to {link!r}: no such heading"


@pytest.mark.parametrize("markdown", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_the_docs_name_exists(markdown):
    for named in NAMED_PATH.findall(markdown.read_text(encoding="utf-8")):
        assert (REPO / named).exists() or (markdown.parent / named).exists(), \
            f"{markdown.name} names {named!r}, which does not exist"
