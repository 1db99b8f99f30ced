"""Heartbeats on NATS (asyncrl.liveness, services/scheduler/liveness.py) against a real
scheduler on port 0 and a real nats-server with its users: beats keep leases, a beat without
the registration's lease key keeps nothing, a forgotten worker is told to register again, the
same process registering again is not bound again while a restarted one is, and no user but
the scheduler may read or forge what the beats carry."""

from __future__ import annotations

import asyncio

import nats
import pytest

from asyncrl.liveness import REWARDS_SUBJECT, Beat, live_subject
from asyncrl.natsutil import connect, wait_until
from services.scheduler.registry import BeatResult
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import (
    REWARD,
    ROLLOUT,
    TRAINER,
    FakeRollout,
    FakeTrainer,
    spec,
    submit,
)

cluster = scheduler_env.cluster
files = scheduler_env.files


async def test_beats_on_nats_keep_the_lease_past_its_ttl(cluster):
    await cluster.start_scheduler(lease_ttl_s=1.0, heartbeat_interval_s=0.2)
    agent, _ = await cluster.worker(REWARD)
    assert agent.subject == live_subject("reward", agent.worker_id) and agent.lease_key
    await asyncio.sleep(2.5)  # 2.5 leases
    counts = cluster.scheduler.liveness.counts
    assert [w.worker_id for w in cluster.scheduler.workers()] == [agent.worker_id]
    assert counts[BeatResult.RENEWED] >= 5 and counts[BeatResult.STALE] == 0


async def test_a_beat_without_the_lease_key_renews_nothing(cluster):
    """Another rollout (same NATS user) beats for a worker with its id and incarnation but
    not its key: the lease lapses all the same."""
    await cluster.start_scheduler(lease_ttl_s=2.0, heartbeat_interval_s=0.2)
    agent, _ = await cluster.worker(ROLLOUT, FakeRollout())
    agent._task.cancel()  # the real worker stops beating
    forger = await connect(cluster.nats_url, identity="rollout")
    try:
        forged = Beat(agent.worker_id, agent.incarnation, "0" * 32, 0, 0.0)
        for _ in range(15):
            await forger.publish(agent.subject, forged.encode())
            await asyncio.sleep(0.2)
        assert cluster.scheduler.workers() == []
        assert cluster.scheduler.liveness.counts[BeatResult.STALE] >= 1  # before it lapsed
    finally:
        await forger.close()


async def test_a_forgotten_worker_is_told_and_registers_again(cluster):
    await cluster.start_scheduler(lease_ttl_s=30.0, heartbeat_interval_s=0.2)
    agent, _ = await cluster.worker(REWARD)
    old = agent.worker_id
    cluster.scheduler.registry.remove(old)  # as a scheduler that restarted knows no one
    await wait_until(lambda: agent.worker_id != old, 5)
    (again,) = cluster.scheduler.workers()
    assert (again.address, again.worker_id) == (agent.address, agent.worker_id)
    assert cluster.scheduler.liveness.counts[BeatResult.UNKNOWN] >= 1


async def test_a_scheduler_that_starts_serving_has_every_worker_register_at_once(cluster):
    """A hand-over's successor (here: a new scheduler on the same port) knows no worker; it
    says it serves on `asyncrl.fleet.scheduler`, and the workers register within a second, not
    at their next heartbeat 30 s away."""
    await cluster.start_scheduler(lease_ttl_s=90.0, heartbeat_interval_s=30.0)
    agent, _ = await cluster.worker(REWARD)
    old = agent.worker_id
    port = cluster.port
    await cluster.stop_scheduler()
    await cluster.start_scheduler(lease_ttl_s=90.0, heartbeat_interval_s=30.0, port=port)
    await wait_until(lambda: bool(cluster.scheduler.workers()), 5)
    (again,) = cluster.scheduler.workers()
    assert again.address == agent.address and agent.worker_id != old


async def test_registering_again_is_no_restart_but_a_new_incarnation_is(cluster, files):
    """A bound rollout registering again from the same process is not bound again (no
    BindExperiment, no UpdateWeights); another process at its address loads the experiment."""
    await cluster.start_scheduler(lease_ttl_s=30.0, heartbeat_interval_s=0.2)
    rollout = FakeRollout(hold=True)
    await cluster.worker(REWARD)
    await cluster.worker(TRAINER, FakeTrainer())
    agent, _ = await cluster.worker(ROLLOUT, rollout)
    exp_id = await submit(cluster, spec(files))
    await wait_until(lambda: len(rollout.group_ids()) >= 1, 10)
    binds, updates = len(rollout.bound), len(rollout.updates)
    await agent.register()
    await asyncio.sleep(0.5)
    assert (len(rollout.bound), len(rollout.updates)) == (binds, updates) == (1, 1)
    agent.incarnation = "restarted0000000"
    await agent.register()
    await wait_until(lambda: len(rollout.bound) == 2 and len(rollout.updates) == 2, 10)
    (worker,) = [w for w in cluster.scheduler.workers() if w.address == agent.address]
    assert worker.experiment_id == exp_id


async def test_rollouts_hear_the_reward_addresses_when_they_change(cluster):
    await cluster.start_scheduler(lease_ttl_s=30.0, heartbeat_interval_s=0.2)
    heard: list[list[str]] = []
    agent, _ = await cluster.worker(ROLLOUT, FakeRollout())
    agent.on_beat = lambda beat: heard.append(list(beat.reward_addresses))
    await agent.nc.subscribe(REWARDS_SUBJECT, cb=agent._rewards)
    await agent.nc.flush()
    reward, _ = await cluster.worker(REWARD)
    await wait_until(lambda: heard and heard[-1] == [reward.address], 5)
    await reward.leave()
    await wait_until(lambda: heard[-1] == [], 5)


async def _violation(nats_url: str, identity: str, act) -> str:
    errors: list[str] = []

    async def record(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await connect(nats_url, identity=identity, error_cb=record)
    try:
        await act(nc)
        await nc.flush()
        await wait_until(lambda: errors, 5)
        return errors[0]
    finally:
        await nc.close()


@pytest.mark.parametrize(
    ("identity", "verb", "subject"),
    [
        ("reward", "publish to", "asyncrl.live.rollout.rollout-1"),
        ("rollout", "publish to", "asyncrl.live.trainer.trainer-1"),
        ("rollout", "subscription to", "asyncrl.live.>"),
        ("trainer", "subscription to", "asyncrl.live.rollout.*"),
        ("viewer", "publish to", "asyncrl.live.reward.reward-1"),
        ("rollout", "publish to", "asyncrl.weights.exp-1"),
        ("rollout", "subscription to", "asyncrl.weights_ack.>"),
        ("trainer", "publish to", "asyncrl.weights_ack.exp-1"),
        ("reward", "subscription to", "asyncrl.weights.>"),
    ],
)
async def test_only_the_scheduler_reads_beats_and_each_kind_beats_as_itself(
    nats_server, identity, verb, subject
):
    async def act(nc: nats.NATS) -> None:
        if verb == "publish to":
            await nc.publish(subject, b"x y z 0 0")
        else:
            await nc.subscribe(subject)

    got = await _violation(nats_server.url, identity, act)
    assert got == f'nats: permissions violation for {verb} "{subject}"'
