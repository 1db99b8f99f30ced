"""Stops and full disks against a real scheduler on port 0 and a real nats-server (issue 23,
points 5 and 10): a stopping scheduler stores every runner's ledger events, a stopping worker
leaves the registry at once, a heartbeat whose log lines hit a full disk keeps the worker
registered, a trainer whose storage is full pauses the run (never counted as failing), and the
supervisor's broker probe tells a broker that refuses writes from one that is away."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import structlog
from structlog.testing import capture_logs

from asyncrl.ledger import read_events
from asyncrl.logging import configure_logging
from asyncrl.natsutil import wait_until
from asyncrl.settings import settings
from asyncrl.supervisor.broker import BrokerWatch
from services.scheduler import core
from services.scheduler.registry import WorkerKind
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import (
    REWARD,
    ROLLOUT,
    TRAINER,
    FakeRollout,
    FakeTrainer,
    running_experiment,
    spec,
    submit,
)

cluster = scheduler_env.cluster
files = scheduler_env.files

STORAGE = "publish weights: storage full: No space left on device at /var/weights (0.0 MiB free)"


async def test_a_stopping_scheduler_stores_every_runners_ledger_events(cluster, files, js):
    """Events emitted just before the stop (one per group the held rollout runs) are in the
    ledger stream after `close`: the runner's writer is flushed before NATS is drained."""
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True)
    exp_id = await running_experiment(cluster, files, rollout)
    await wait_until(lambda: len(rollout.group_ids()) >= 2, 10)
    ledger = cluster.scheduler.get(exp_id).dispatcher.ledger
    marks = [f"flush-test-{i}" for i in range(50)]
    for mark in marks:
        ledger.emit("retried", group=mark, reason="test")
    await cluster.stop_scheduler()
    events = await read_events(js, exp_id)
    stored = {e.get("group") for e in events if e.get("reason") == "test"}
    assert stored == set(marks)


async def test_a_leaving_worker_is_gone_at_once(cluster):
    """No lease to wait for (10 s by default): the reward address is out of the list the
    next dispatch carries as soon as `leave` returns."""
    await cluster.start_scheduler(lease_ttl_s=30.0)
    agent, _ = await cluster.worker(REWARD)
    assert cluster.scheduler.registry.reward_addresses() == [agent.address]
    await agent.leave()
    assert cluster.scheduler.registry.reward_addresses() == []
    assert [w.kind for w in cluster.scheduler.workers()] == []


async def test_a_leaving_rollout_finishes_its_groups_and_gets_no_new_ones(cluster, files, js):
    """Drain: its calls in flight are not cancelled (no re-queue, no second attempt); once
    released they settle as the rollout answers them, and nothing more is sent to it."""
    await cluster.start_scheduler(lease_ttl_s=30.0)
    rollout = FakeRollout(hold=True)
    await cluster.worker(REWARD)
    await cluster.worker(TRAINER, FakeTrainer())
    agent, _ = await cluster.worker(ROLLOUT, rollout)
    exp_id = await submit(cluster, spec(files))
    await wait_until(lambda: len(rollout.group_ids()) >= 2, 10)
    await agent.leave()
    held = rollout.group_ids()
    rollout.release.set()

    async def settled() -> set[str]:
        events = await read_events(js, exp_id)
        return {e["group"] for e in events if e["event"] == "settled"}

    deadline = time.monotonic() + 10
    while not set(held) <= await settled() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert set(held) <= await settled()
    assert rollout.cancelled == [] and rollout.group_ids() == held


async def test_a_heartbeat_waits_for_a_scheduler_replaced_on_its_port(cluster):
    """The scheduler closed and one bound its port 1.5 s later (a hand-over; heartbeats every
    0.2 s): the worker's heartbeat waits for the connection and reaches the new one, which does
    not know it, and it registers there at once. No heartbeat failed in between (they did after
    3 refused attempts, each after a backoff sleep that delayed the registration)."""
    await cluster.start_scheduler()
    agent, _ = await cluster.worker(REWARD)
    first, port = agent.worker_id, cluster.port
    with capture_logs() as logs:
        await cluster.stop_scheduler()
        await asyncio.sleep(1.5)
        await cluster.start_scheduler(port=port)
        await wait_until(lambda: cluster.scheduler.registry.get(agent.worker_id or ""), 10)
    events = [e["event"] for e in logs]
    assert agent.worker_id != first
    assert "worker_unknown_reregistering" in events and "heartbeat_failed" not in events


async def test_a_heartbeat_logging_onto_a_full_disk_keeps_the_worker_registered(cluster):
    """The scheduler forgets the worker (as after its restart): the agent logs
    `worker_unknown_reregistering` onto /dev/full and still registers again."""
    await cluster.start_scheduler()
    with open("/dev/full", "w") as full:
        sink = configure_logging("test", json=True, stream=full)
        try:
            agent, _ = await cluster.worker(TRAINER, FakeTrainer())
            first = agent.worker_id
            cluster.scheduler.registry.remove(first)
            await wait_until(lambda: agent.worker_id != first, 10)
            await wait_until(lambda: cluster.scheduler.registry.get(agent.worker_id), 10)
            assert sink.dropped >= 1
        finally:
            structlog.reset_defaults()


async def test_a_trainer_with_a_full_disk_pauses_the_run_and_it_resumes(cluster, files):
    """Its storage failures are not counted (max_start_failures 2 would fail the run after
    the second): the run waits with the reason, and runs again once the trainer stores."""
    await cluster.start_scheduler(trainer_poll_interval_s=0.2, max_start_failures=2)
    trainer = FakeTrainer()
    exp_id = await running_experiment(cluster, files, FakeRollout(hold=True), trainer)
    runner = cluster.scheduler.get(exp_id)
    trainer.fail(STORAGE)
    await wait_until(lambda: len(trainer.started) >= 4, 20)  # started again, again, again
    assert runner.state.value != "FAILED"
    assert runner.supervisor.paused == f"trainer {runner.supervisor.trainer_id}: {STORAGE}"
    trainer.failure = "load: TimeoutError: nats: timeout"  # space back, NATS recovering
    started = len(trainer.started)
    await wait_until(lambda: len(trainer.started) >= started + 3, 20)
    assert runner.state.value != "FAILED"
    trainer.failure = ""  # space returned: it starts, and commits
    await wait_until(lambda: trainer.state == "waiting" and runner.state.value == "RUNNING", 20)
    await cluster.commit(exp_id, 1)
    assert runner.supervisor.paused == ""
    assert runner.registry.bound(exp_id, WorkerKind.TRAINER)


async def test_a_full_var_dir_is_the_experiments_message_until_space_returns(
    cluster, files, monkeypatch
):
    """More free bytes needed than any disk has: the var dir counts as full, and the message
    says so and where; needing none again, the message is cleared."""
    monkeypatch.setattr(core, "STORAGE_CHECK_S", 0.05)
    monkeypatch.setattr(core, "STORAGE_MIN_FREE", 2**62)
    await cluster.start_scheduler()
    exp_id = await running_experiment(cluster, files, FakeRollout(hold=True))
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.record.message.startswith("paused: storage full: "), 10)
    message = (await cluster.experiment(exp_id)).message
    assert message.startswith("paused: storage full: ")
    assert message.endswith(f" MiB free at {settings().var.resolve()}")
    monkeypatch.setattr(core, "STORAGE_MIN_FREE", 0)
    await wait_until(lambda: runner.record.message == "", 10)
    assert runner.state.value == "RUNNING"


def test_the_broker_probe_tells_a_refusing_broker_from_a_full_disk(nats_server, tmp_path):
    """nats-server frozen (SIGSTOP): connected, every probe write times out while the store's
    disk has room -> stuck, with the reason. The same with a disk counted as full (more free
    bytes needed than there are) -> never stuck: that broker is right to refuse."""
    store = nats_server.store_dir
    watch = BrokerWatch(nats_server.url, store, every_s=0.1, timeout_s=0.3, limit=3)
    full = BrokerWatch(nats_server.url, store, every_s=0.1, timeout_s=0.3, min_free_bytes=2**62)
    watch.start()
    full.start()
    try:
        time.sleep(1.5)
        assert watch.stuck() == "" and full.stuck() == ""
        os.kill(nats_server.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while not watch.stuck() and time.monotonic() < deadline:
                time.sleep(0.1)
            why = watch.stuck()
            assert why.startswith("3 probe writes refused in a row") or "in a row" in why
            assert str(store) in why and full.stuck() == ""
        finally:
            os.kill(nats_server.proc.pid, signal.SIGCONT)
        watch.reset()
        time.sleep(1.0)
        assert watch.stuck() == ""
    finally:
        watch.stop()
        full.stop()


@pytest.fixture(autouse=True)
def _structlog_defaults():
    yield
    structlog.reset_defaults()
