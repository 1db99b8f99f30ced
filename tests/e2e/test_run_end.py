"""How a run ends under `make up`, and what the ledger then says of every prompt.

A model that diverges: `trainer.lr: 1e30` (a valid float) moves every weight by ~1e30 in the
first step, finite in fp32 but overflowing the next forward. The run must stop FAILED at that
version, with the reason, before any rollout serves it: the prompts it did not reach stay
untouched and none is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from asyncrl.client import AsyncrlClient, is_terminal, state_name
from asyncrl.ledger import fetch_report
from tests.e2e.experiment import run_experiment, small_spec

pytestmark = pytest.mark.timeout(600)

COIN_REWARD = "plugin:tests.fixtures_plugins.rewards:coin"


def test_lr_1e30_run_failed_diverged_at_v1_untouched_prompts_not_failed(cluster, task):
    spec = small_spec(task, total_steps=200, lr=1e30)
    spec["dataset"]["epochs"] = 1
    spec["eval"] = {}
    # rewards that differ inside a group (a random model never adds up): a gradient to follow
    spec["reward"] = {"function": COIN_REWARD}
    exp = asyncio.run(run_experiment(cluster.scheduler, spec, timeout=240))
    assert state_name(exp.state) == "FAILED", exp.message
    assert exp.message.startswith("diverged: non-finite weights at v1 "), exp.message
    assert exp.progress.version == 0  # v1 was never committed, so never served
    ledger = asyncio.run(fetch_report(exp.id, f"nats://127.0.0.1:{cluster.nats_port}"))
    assert ledger.steps == 0, ledger.totals
    assert ledger.totals["lost"] == 0, ledger.totals
    assert ledger.totals["failed"] == 0, ledger.totals
    assert ledger.totals["in_flight"] == 0, ledger.totals
    assert len(ledger.prompts) < 64  # the prompts it did not reach: in no fate at all


def test_cancel_mid_run_trainer_frozen_message_status_and_ledger_agree(cluster, task):
    """The trainer is frozen (SIGSTOP) when the run is cancelled, holding accepted groups it
    has not trained: it cannot write them as left over, yet they are left over, not lost, and
    the final message, `progress.left_over` and the ledger give the same figure. It is frozen
    where its ledger holds every committed step (not between a commit and its record)."""
    spec = small_spec(task, total_steps=200)
    spec["eval"] = {}
    spec["reward"] = {"function": COIN_REWARD}
    nats_url = f"nats://127.0.0.1:{cluster.nats_port}"
    (trainer,) = cluster.procs("trainer")
    frozen: list[int] = []

    async def freeze_trainer(client, exp_id) -> None:
        while True:
            os.kill(trainer["pid"], signal.SIGSTOP)
            frozen.append(trainer["pid"])
            await asyncio.sleep(0.3)  # what it sent before is handled and stored
            exp = await client.get(exp_id)
            # every committed version in its ledger: the newest commit, not the fleet's version
            # (under broadcast the fleet waits for the frozen trainer's send)
            if (await fetch_report(exp_id, nats_url)).steps == exp.weights_version:
                return
            os.kill(trainer["pid"], signal.SIGCONT)
            frozen.remove(trainer["pid"])
            await asyncio.sleep(0.05)

    async def run_and_cancel():
        async with AsyncrlClient(cluster.scheduler) as client:
            exp = await client.submit(spec)
            deadline = time.monotonic() + 120
            while exp.progress.version < 2:
                assert time.monotonic() < deadline, exp.message
                await asyncio.sleep(0.1)
                exp = await client.get(exp.id)
            await freeze_trainer(client, exp.id)
            while exp.progress.accepted - exp.progress.trained_groups < 2:  # held by it
                assert time.monotonic() < deadline, exp.progress
                await asyncio.sleep(0.1)
                exp = await client.get(exp.id)
            await client.cancel(exp.id)
            while not is_terminal(exp):
                assert time.monotonic() < deadline + 60, exp.message
                await asyncio.sleep(0.2)
                exp = await client.get(exp.id)
            return exp

    try:
        exp = asyncio.run(run_and_cancel())
        ledger = asyncio.run(fetch_report(exp.id, nats_url))
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert state_name(exp.state) == "CANCELLED", exp.message
    totals = ledger.totals
    assert totals["lost"] == 0 and totals["in_flight"] == 0, f"{exp.message}: {totals}"
    assert totals["trained_twice"] == 0, totals
    assert exp.progress.left_over == totals["left_over"], (exp.progress.left_over, totals)
    if totals["left_over"]:
        assert f"; {totals['left_over']} prompts left over" in exp.message, (exp.message, totals)
    else:
        assert "left over" not in exp.message, (exp.message, totals)
