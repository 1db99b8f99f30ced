"""The short version of `make multihost`: three hosts in network namespaces (scheduler +
trainer, two rollouts, reward + a rollout), a three-node NATS cluster with the stream and the
KV bucket at replicas 3, weights through the NATS object store, the arith experiment run from
the operator's address. The ledger must show every prompt's fate with none lost or trained
twice, and no rollout host may hold a file of the trainer's weight store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")),
        reason="network namespaces need root, unshare and ip",
    ),
]


def test_short_multihost_run_completes_across_three_hosts(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tests.multihost", "--short", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    report = json.loads((tmp_path / "report.json").read_text())
    (row,) = report["runs"]
    assert done.returncode == 0, f"{row.get('error')}\n{done.stdout[-3000:]}"
    assert row["completed"] and row["steps"] == 6
    assert row["lost"] == 0 and row["trained_twice"] == 0 and row["failed"] == 0
    assert row["trained_groups"] == 6 * 4
    for name, info in row["nats"].items():
        assert info["replicas"] == 3 and info["peers"] == ["nats-a", "nats-b", "nats-c"], name
    weights = row["weights"]
    assert weights["leaked"] == []
    assert weights["uri_schemes"] == {"b": ["nats-obj", "path"], "c": ["nats-obj", "path"]}
    assert weights["cached"]["b"] >= 1 and weights["cached"]["c"] >= 1
