"""Run control under `make up`: a small experiment on the tiny model, checkpointed on demand
(`asyncrl checkpoint`), cancelled mid-run, resumed (`asyncrl resume`) and run to the end of
its data; the ledger judges it: every prompt trained exactly once, nothing lost, nothing
trained twice, nothing left over, across the cancel and the resume."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from asyncrl.cli import app as cli_app
from asyncrl.client import AsyncrlClient, is_terminal, state_name
from tests.e2e.experiment import ledger_report, small_spec

pytestmark = pytest.mark.timeout(900)

B = 2
EPOCHS = 3
CANCEL_AT = 3
"""The fleet version at which the run is cancelled (of 3 x 64 prompts / B = 96 steps)."""


def cli(cluster, *args: str) -> str:
    result = CliRunner().invoke(cli_app, ["--scheduler", cluster.scheduler, *args])
    assert result.exit_code == 0, result.output
    return result.output


async def poll_until(client: AsyncrlClient, exp_id: str, pred, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        exp = await client.get(exp_id)
        if pred(exp):
            return exp
        assert time.monotonic() < deadline, f"{state_name(exp.state)}: {exp.message}"
        await asyncio.sleep(0.1)


def test_cancelled_run_resumed_completes_every_prompt_trained_once(cluster, task):
    spec = small_spec(task, total_steps=10_000, checkpoint_every=1_000, batch_size=B)
    spec["dataset"]["epochs"] = EPOCHS  # the run ends when its data does
    spec["eval"] = {}
    n_prompts = EPOCHS * sum(1 for _ in Path(task[1]).open())  # a prompt of each epoch

    async def until_cancelled():
        async with AsyncrlClient(cluster.scheduler) as client:
            exp = await client.submit(spec)
            await poll_until(client, exp.id, lambda e: e.progress.version >= CANCEL_AT, 300)
            return exp.id

    exp_id = asyncio.run(until_cancelled())
    saved = cli(cluster, "checkpoint", exp_id)
    assert "checkpoint at step" in saved and "step_" in saved, saved
    assert "CANCELLED" in cli(cluster, "cancel", exp_id)
    before = ledger_report(cluster, _Exp(exp_id))
    assert before["totals"]["trained"] < n_prompts, before["totals"]
    # what the resume picks up: the prompts left over (the groups in flight or accepted but not
    # trained at the cancel: none when it lands between a step and the next dispatch, as on a
    # loaded machine) and those never dispatched
    assert before["totals"]["trained_twice"] == before["totals"]["lost"] == 0, before["totals"]

    resumed = cli(cluster, "resume", exp_id)
    assert f"{exp_id}: PENDING (resumed from CANCELLED)" in resumed, resumed

    async def until_ended():
        async with AsyncrlClient(cluster.scheduler) as client:
            return await poll_until(client, exp_id, is_terminal, 600)

    exp = asyncio.run(until_ended())
    assert state_name(exp.state) == "COMPLETED", exp.message
    assert "dataset exhausted" in exp.message
    report = ledger_report(cluster, exp)
    totals = report["totals"]
    assert totals == {**totals, "trained": n_prompts}, totals
    assert totals["trained_twice"] == totals["lost"] == totals["left_over"] == 0, totals
    assert totals["in_flight"] == totals["filtered"] == totals["failed"] == 0, totals
    assert report["steps"] == exp.progress.version == n_prompts // B
    assert report["trained_groups"] == n_prompts
    assert all(len(p["trained"]) == 1 for p in report["prompts"])


class _Exp:
    """What `ledger_report` reads of an experiment: its id."""

    def __init__(self, experiment_id: str):
        self.id = experiment_id
