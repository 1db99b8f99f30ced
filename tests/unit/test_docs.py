"""The docs' links and README's commands stay valid: every relative link in README.md and
docs/*.md names a file that exists (no anchors: a heading's slug is not checked), README's
first two commands are `make demo` and `make test` (what a new user runs first, and what
`.ci/run` runs), and every `make TARGET` README names is a target of the Makefile."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
MAKE = re.compile(r"\bmake ([a-z][a-z0-9_-]*)")
TARGET = re.compile(r"^([a-zA-Z0-9_-]+):", re.M)


def relative_links(text: str) -> list[str]:
    """The targets of a markdown page's links and images that point into the repository."""
    return [t for t in LINK.findall(text) if not EXTERNAL.match(t)]


def broken_links(page: Path) -> list[str]:
    """`target (why)` for each relative link of `page` that has an anchor or names no file."""
    bad = []
    for target in relative_links(page.read_text(encoding="utf-8")):
        if "#" in target:
            bad.append(f"{target} (an anchor)")
        elif not (page.parent / target).resolve().exists():
            bad.append(f"{target} (no such file)")
    return bad


def first_commands(text: str, n: int) -> list[str]:
    """The first `n` commands of the page's code blocks: lines without their comments."""
    commands = []
    for block in FENCE.findall(text):
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                commands.append(command)
    return commands[:n]


def makefile_targets() -> set[str]:
    return set(TARGET.findall((ROOT / "Makefile").read_text(encoding="utf-8")))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_docs_link_check_catches_a_missing_file_and_an_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text(
        "[ok](there.md) [gone](gone.md) ![img](there.md) [a](there.md#part) [web](https://x.y)"
    )
    assert broken_links(page) == ["gone.md (no such file)", "there.md#part (an anchor)"]


def test_readme_first_two_commands_are_make_demo_and_make_test():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert first_commands(text, 2) == ["make demo", "make test"]


def test_readme_make_targets_exist_in_the_makefile():
    named = set(MAKE.findall((ROOT / "README.md").read_text(encoding="utf-8")))
    assert {"demo", "test", "up"} <= named  # the extraction works
    assert named - makefile_targets() == set()


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 220
