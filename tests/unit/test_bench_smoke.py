"""Smoke run of every benchmark at its smallest size: the report's structure, never timings
(speed is reported by `make bench`, not asserted in tests)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import BENCHMARKS
from bench.__main__ import run_benchmarks
from bench.report import Result, build_report, render_table

# its module fixture runs every benchmark once (minutes on a busy 2-core machine)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
RESULT_KEYS = {"name", "metric", "value", "unit", "peer", "peer_value", "ratio", "settings"}


LONG = {"offpolicy", "scale", "shared_fleet"}
"""Minutes each even at --quick (four experiments; a hundred stand-in workers; eight LoRA runs
on a scaled cluster): run by `make bench`; their logic is tested in test_bench_offpolicy.py,
test_bench_scale.py and tests/e2e/test_shared_fleet.py."""


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    names = [n for n in BENCHMARKS if n not in LONG]
    return run_benchmarks(names, quick=True, work_dir=tmp_path_factory.mktemp("b"))


@pytest.mark.slow  # runs every benchmark, models included: left out of make test-fast
def test_quick_run_every_benchmark_reports_or_skips_with_reason(quick_run):
    results, skipped = quick_run
    reported = {r.name for r in results}
    assert reported | {s["name"] for s in skipped} == set(BENCHMARKS) - LONG
    assert not reported & {s["name"] for s in skipped}
    assert all(s["reason"] for s in skipped)
    assert {"rollout", "interrupt", "transport"} <= reported  # nothing optional in these


@pytest.mark.slow  # runs every benchmark, models included: left out of make test-fast
def test_quick_run_results_have_positive_peers_and_consistent_ratios(quick_run):
    results, _ = quick_run
    for r in results:
        assert r.metric and r.peer and r.unit, r
        assert isinstance(r.settings, dict) and r.settings, r
        assert r.peer_value > 0 and math.isfinite(r.peer_value), r
        assert math.isfinite(r.value), r
        assert r.ratio == pytest.approx(r.value / r.peer_value)


@pytest.mark.slow  # runs every benchmark, models included: left out of make test-fast
def test_quick_run_rollout_compares_kv_engine_with_both_peers(quick_run):
    results, _ = quick_run
    peers = {r.peer for r in results if r.name == "rollout"}
    assert peers == {
        "TorchEngine without KV cache",
        "sequential HF model.generate",
        "the batched forwards alone (HF, KV cache, argmax)",
    }
    interrupt = [r for r in results if r.name == "interrupt"]
    # the update lands mid-batch; how many requests are still running when it does depends on
    # the machine's load (the engine's own tests pin that every one of them moves)
    assert interrupt and all(
        0 <= r.settings["interrupted"] <= r.settings["in_flight"] for r in interrupt
    )


@pytest.mark.slow  # runs every benchmark, models included: left out of make test-fast
def test_build_report_serialises_results_machine_and_skips(quick_run):
    results, skipped = quick_run
    report = build_report(results, skipped, quick=True, command=["python", "-m", "bench"])
    back = json.loads(json.dumps(report))
    assert back["machine"]["cpu_count"] >= 1 and back["machine"]["torch"]
    assert len(back["results"]) == len(results)
    assert all(RESULT_KEYS <= set(r) for r in back["results"])
    assert render_table(report).row_count == len(results) + len(skipped)


def test_result_ratio_zero_peer_is_infinite():
    assert Result("x", "m", 1.0, "s", "p", 0.0).ratio == math.inf


def test_cli_only_admission_quick_writes_json_report(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "admission", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["quick"] is True
    assert report["command"][-4:] == ["--only", "admission", "--out", str(out)]
    assert {r["name"] for r in report["results"]} | {s["name"] for s in report["skipped"]} == {
        "admission"
    }
    assert "admission" in proc.stdout  # the table
