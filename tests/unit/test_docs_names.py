"""The docs name only what the code has: every `backticked` name that looks like code in
docs/architecture.md (and the other docs in DOCS) is found in the code, every path exists. A
rename that forgets the docs fails here instead of drifting silently (issue 20 found
`partition_by_staleness`, `access_token_call_credentials` and a `_single_turn` path that were
gone from the code but still in the architecture doc)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    "docs/architecture.md",
    "README.md",
    "docs/workflows.md",
    "docs/operations.md",
    "docs/failures.md",
    "docs/security.md",
    "docs/objective.md",
    "docs/rewards.md",
]
CODE_DIRS = ["libs/asyncrl", "services", "protos", "bench", "examples", "tests/chaos", "tests/fuzz"]
CODE_FILES = ["Makefile", "pyproject.toml"]

EXTERNAL = {"GroupedRolloutWorkflow", "os._exit"}
"""Other projects' names the docs cite (AReaL's, Python's)."""

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


@functools.cache
def code_files() -> dict[Path, str]:
    files = {}
    for d in CODE_DIRS:
        for path in sorted((ROOT / d).rglob("*")):
            if path.suffix in (".py", ".proto") and "_pb2" not in path.name:
                files[path] = path.read_text(encoding="utf-8")
    for name in CODE_FILES:
        files[ROOT / name] = (ROOT / name).read_text(encoding="utf-8")
    return files


@functools.cache
def words() -> frozenset[str]:
    return frozenset(w for text in code_files().values() for w in re.findall(r"\w+", text))


@functools.cache
def class_files(name: str) -> list[str]:
    """The text of every file that defines class (or proto message / service / enum) `name`."""
    pattern = re.compile(rf"^\s*(?:class|message|service|enum)\s+{re.escape(name)}\b", re.M)
    return [text for text in code_files().values() if pattern.search(text)]


def code_like(name: str) -> bool:
    """A name a reader would grep for: dotted, with an underscore, CamelCase or a call; plain
    lowercase words (`eval`, `trained`: ledger events, states) are prose."""
    return "." in name or "_" in name or re.search(r"[a-z][A-Z]", name) is not None


def missing(name: str) -> str:
    """Why `name` is not in the code ("" when it is)."""
    if name.startswith("ASYNCRL_") and name not in words():  # a setting's field
        field = name.removeprefix("ASYNCRL_").lower()
        return "" if field in words() else f"no setting {field}"
    parts = name.split(".")
    absent = [p for p in parts if p not in words()]
    if absent:
        return f"{', '.join(absent)} not in the code"
    for owner, member in zip(parts, parts[1:], strict=False):
        texts = class_files(owner)
        if texts and not any(defines(t, member) for t in texts):
            return f"{owner} has no {member}"
    return ""


def defines(text: str, member: str) -> bool:
    """Whether `text` defines or uses `member` as code (a def, an assignment, an attribute, a
    proto field or rpc), not merely as a word of a docstring."""
    m = re.escape(member)
    pattern = rf"\b(?:def|class|rpc) {m}\b|\.{m}\b|^\s*{m}\s*[:=]|\b{m}\s*=\s*\d"
    return re.search(pattern, text, re.M) is not None


def spans(doc: str) -> list[str]:
    text = FENCE.sub("", (ROOT / doc).read_text(encoding="utf-8"))
    return [s.strip() for s in SPAN.findall(text)]


def names(doc: str) -> list[str]:
    out = []
    for span in spans(doc):
        span = span.removesuffix("()")
        if IDENT.fullmatch(span) and code_like(span):
            out.append(span)
    return out


def paths(doc: str) -> list[str]:
    """Spans that are paths in the repository (their first part is a top-level entry)."""
    top = {p.name for p in ROOT.iterdir()} - {"var"}  # var/: what a run writes
    return [
        s for s in spans(doc) if re.fullmatch(r"[\w.-]+/[\w./-]*", s) and s.split("/")[0] in top
    ]


@pytest.mark.parametrize("doc", DOCS)
def test_every_code_name_in_the_doc_is_in_the_code(doc):
    found = names(doc)
    assert len(found) >= 10, "the extraction found almost nothing: is the doc still there?"
    wrong = {n: why for n in dict.fromkeys(found) if n not in EXTERNAL and (why := missing(n))}
    assert not wrong, f"{doc} names what the code does not have: {wrong}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_in_the_doc_exists(doc):
    gone = [p for p in paths(doc) if not (ROOT / p).exists()]
    assert not gone, f"{doc} names paths that do not exist: {gone}"


def test_architecture_opens_with_the_reading_path():
    text = (ROOT / "docs/architecture.md").read_text(encoding="utf-8")
    first = re.search(r"^## (.+)$", text, re.M)
    assert first is not None and first.group(1).lower().startswith("read these files")


@pytest.mark.parametrize(
    "name, why",
    [
        ("Dispatcher.dispatch_one", ""),
        ("Dispatcher.no_such_method", "no_such_method not in the code"),
        ("partition_by_staleness", "partition_by_staleness not in the code"),
        ("ExperimentRunner.commit", "ExperimentRunner has no commit"),
        ("ASYNCRL_INSECURE", ""),
    ],
)
def test_the_check_itself(name, why):
    assert code_like(name)
    assert missing(name) == why
