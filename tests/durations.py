"""`python -m tests.durations REPORT.xml`: write tests/durations.json, the seconds each test
file took in a pytest JUnit report (setup, calls and teardown), for the files over a few
seconds. `make test` starts the longest files first (tests/conftest.py)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "durations.json"
MIN_S = 5.0
"""Files shorter than this are left out: they fill the gaps in any order."""


def test_file(classname: str) -> str:
    """tests.unit.test_x (or tests.unit.test_x.TestClass) -> tests/unit/test_x.py"""
    parts = classname.split(".")
    while parts and not (ROOT / "/".join(parts)).with_suffix(".py").is_file():
        parts.pop()
    return "/".join(parts) + ".py"


def file_seconds(report: Path) -> dict[str, int]:
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).iter("testcase"):
        seconds[test_file(case.get("classname", ""))] += float(case.get("time", 0))
    return {path: round(s) for path, s in seconds.most_common() if s >= MIN_S}


if __name__ == "__main__":
    OUT.write_text(json.dumps(file_seconds(Path(sys.argv[1])), indent=1) + "\n")
    print(f"wrote {OUT}")
