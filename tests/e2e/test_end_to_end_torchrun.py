"""The small experiment with the trainer under torchrun: `make up` with
ASYNCRL_TRAINER_NPROC=2 and a megatron spec with trainer.tp_size=2 (two gloo ranks on CPU).

Rank 0 serves gRPC and drives the backend; rank 1 follows its calls. The experiment must
complete with the same invariants as the single-process trainer, and `make down` must leave
no rank behind."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.cluster import Cluster
from tests.e2e.experiment import (
    assert_completed,
    log_events,
    run_experiment,
    small_spec,
)

pytestmark = pytest.mark.timeout(900)


def processes_using(var: Path) -> list[int]:
    """Live pids whose environment points ASYNCRL_VAR at `var` (the supervised services)."""
    marker = f"ASYNCRL_VAR={var.resolve()}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_megatron_tp2_trainer_under_torchrun_completes_and_stops_cleanly(task, tmp_path):
    pytest.importorskip("megatron.core")
    c = Cluster(tmp_path / "var")
    c.env["ASYNCRL_TRAINER_NPROC"] = "2"
    try:
        started = c.sup("start", "--timeout", "240", timeout=300)
        assert started.returncode == 0, started.stdout + started.stderr
        spec = small_spec(task, backend="megatron", tp_size=2)
        exp = asyncio.run(run_experiment(c.scheduler, spec))
        assert_completed(exp)
        # scheduler, reward, rollout, torchrun and its two ranks at least
        assert len(processes_using(c.var)) >= 6, processes_using(c.var)
        stopped = c.sup("stop", timeout=180)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert processes_using(c.var) == []  # torchrun and both ranks are gone
    finally:
        c.kill_all()
    log = (c.var / "log" / "trainer-0.log").read_text()
    started_events = log_events(c.var / "log" / "trainer-0.log", "experiment_started")
    assert [(e["backend"], e["experiment"]) for e in started_events] == [("megatron", exp.id)]
    assert "trainer_shutting_down" in log
    assert "terminate called" not in log and "SIGKILL" not in log, log[-3000:]
