"""Every class, module and function in `services/` and `libs/` reads in one sitting (issue 20,
acceptance 2): no class over 400 lines, no module over 600, no function over 60. Generated
protobuf code is left out. Lines count from the `def`/`class` line to the body's last line
(decorators excluded), as `ast` gives them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"module": 600, "class": 400, "function": 60}


GENERATED = ROOT / "libs/asyncrl/v1"
"""`make protos` writes the protobuf modules there."""


def sources() -> list[Path]:
    return [
        path
        for top in ("services", "libs")
        for path in sorted((ROOT / top).rglob("*.py"))
        if not path.is_relative_to(GENERATED)
    ]


def sizes(path: Path, root: Path = ROOT) -> list[tuple[str, str, int]]:
    """(kind, name, lines) of the module and of every class and function in it."""
    text = path.read_text()
    where = path.relative_to(root)
    out = [("module", str(where), len(text.splitlines()))]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            kind = "class"
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "function"
        else:
            continue
        out.append((kind, f"{where}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1))
    return out


def test_the_tree_has_sources_to_measure():
    files = sources()
    assert len(files) > 50
    assert ROOT / "services/scheduler/experiments.py" in files
    assert not any(p.name.endswith("_pb2.py") for p in files)


@pytest.mark.parametrize("kind", sorted(LIMITS))
def test_no_piece_of_code_is_over_its_limit(kind):
    over = [
        f"{name}: {lines} lines"
        for path in sources()
        for k, name, lines in sizes(path)
        if k == kind and lines > LIMITS[kind]
    ]
    assert not over, f"over {LIMITS[kind]} lines ({kind}): " + "; ".join(over)


def test_sizes_counts_a_class_from_its_line_to_its_last(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("@dec\nclass A:\n    def f(self):\n        return 1\n\n\nx = 2\n")
    got = {(k, n.split(" ")[-1]): lines for k, n, lines in sizes(module, tmp_path)}
    assert got == {("module", "m.py"): 7, ("class", "A"): 3, ("function", "f"): 2}
