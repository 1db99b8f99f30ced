"""`trainer.weight_sync: broadcast` through all services, started the way `make up` starts them:
the trainer streams every version to the torch rollouts over one gloo group on loopback, and a
second rollout that joins mid-run loads the newest stored version first, then takes the
broadcasts (the group rebuilt with it)."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.client import AsyncrlClient, is_terminal, state_name
from asyncrl.net import free_port
from tests.e2e.experiment import (
    assert_ledger_clean,
    log_events,
    small_spec,
    start_cluster,
)

pytestmark = pytest.mark.timeout(900)
STEPS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from start_cluster(tmp_path_factory.mktemp("var"), engine="torch")


def test_broadcast_run_completes_and_a_joining_rollout_takes_the_store_then_the_stream(
    cluster, task
):
    spec = small_spec(
        task,
        total_steps=STEPS,
        weight_sync="broadcast",
        nccl_master=f"127.0.0.1:{free_port()}",
    )

    async def scenario():
        async with AsyncrlClient(cluster.scheduler) as client:
            exp = await client.submit(spec)
            deadline = time.monotonic() + 300
            while (await client.get(exp.id)).progress.version < 3:
                assert time.monotonic() < deadline and not is_terminal(await client.get(exp.id))
                await asyncio.sleep(0.5)
            done = await asyncio.to_thread(cluster.sup, "scale", "rollout", "2")
            assert done.returncode == 0, done.stdout + done.stderr
            while not is_terminal(exp := await client.get(exp.id, with_history=True)):
                assert time.monotonic() < deadline + 300
                await asyncio.sleep(0.5)
            return exp

    exp = asyncio.run(scenario())
    assert state_name(exp.state) == "COMPLETED", exp.message
    assert exp.progress.version == STEPS
    assert_ledger_clean(cluster, exp)
    log = cluster.var / "log"
    sent = [e for e in log_events(log / "trainer-0.log", "broadcast_sent")]
    assert sent and max(e["rollouts"] for e in sent) == 2, sent
    assert all(e["bytes"] > 0 for e in sent)
    assert not log_events(log / "scheduler-0.log", "weights_fingerprint_mismatch")
    joined = [e for e in log_events(log / "rollout-1.log", "weights_updated")]
    streamed = log_events(log / "rollout-1.log", "weights_streamed")
    assert joined and streamed, "the second rollout loads from the store, then streams"
    first_streamed = streamed[0]["version"]
    assert joined[0]["version"] < first_streamed  # the stored version came first
    assert log_events(log / "rollout-0.log", "weights_streamed")
