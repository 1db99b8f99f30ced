"""A fault under `make up`, in CI: kill -9 of the trainer mid-run. The supervisor restarts it,
the scheduler re-drives the experiment on the new trainer (resuming from its checkpoint), and
the ledger proves the run lost no prompt and trained none twice. The whole fault suite, one
network namespace per scenario, is `make chaos` (tests/chaos)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from asyncrl.client import state_name
from asyncrl.ledger import fetch_report
from tests.e2e.experiment import run_experiment, small_spec

pytestmark = pytest.mark.timeout(600)

TOTAL_STEPS = 300
"""Long enough to be seen running at KILL_AT: 10 steps of this tiny experiment can all pass
between two progress polls (CI saw it end before the kill)."""
KILL_AT = 3
B = 2


def test_trainer_killed_mid_run_experiment_completes_nothing_lost_or_trained_twice(cluster, task):
    spec = small_spec(task, total_steps=TOTAL_STEPS, checkpoint_every=2, batch_size=B)
    spec["eval"] = {}  # no eval: the trainer's work is the point
    killed: list[int] = []
    (before,) = cluster.procs("trainer")

    def kill_trainer_once(exp) -> None:
        if not killed and exp.progress.version >= KILL_AT:
            (trainer,) = cluster.procs("trainer")
            os.kill(trainer["pid"], signal.SIGKILL)
            killed.append(exp.progress.version)

    exp = asyncio.run(
        run_experiment(
            cluster.scheduler, spec, timeout=300, on_progress=kill_trainer_once, poll_s=0.1
        )
    )
    assert killed, "the experiment ended before the trainer was killed"
    assert cluster.procs("trainer")[0]["restarts"] > before["restarts"]
    assert state_name(exp.state) == "COMPLETED", exp.message
    ledger = asyncio.run(fetch_report(exp.id, f"nats://127.0.0.1:{cluster.nats_port}"))
    assert ledger.totals["lost"] == 0, ledger.totals
    assert ledger.totals["trained_twice"] == 0, ledger.totals
    assert ledger.steps == TOTAL_STEPS
    assert ledger.trained_groups == TOTAL_STEPS * B
