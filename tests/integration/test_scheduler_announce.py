"""One announcement per commit (services/scheduler/announce.py, asyncrl.announcements)
against a real scheduler on port 0 and a real nats-server with its users: a commit reaches
the ready rollouts as one NATS message and their answers (fingerprints) come back on NATS; a
rollout that does not answer within the deadline is fenced, and an answer without the
rollout's lease key is no answer."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from asyncrl.announcements import WeightsFollower
from asyncrl.liveness import ACK_ROOT, WEIGHTS_ROOT
from asyncrl.natsutil import connect, wait_until
from asyncrl.v1 import scheduler_pb2
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


class SilentRollout(FakeRollout):
    """Takes its first weights (the join, over the RPC) but never answers an announcement."""

    async def UpdateWeights(self, request, context):
        if context is None:
            await asyncio.Event().wait()
        return await super().UpdateWeights(request, context)


def _fenced(logs) -> list[tuple[str, str]]:
    return [(e["worker"], e["reason"]) for e in logs if e["event"] == "rollout_fenced"]


async def _running(cluster, files, rollouts, **sections) -> tuple[str, list]:
    """Scheduler, reward, trainer, `rollouts`; the experiment with every rollout ready (its
    heartbeats on NATS). Returns (experiment id, agents)."""
    await cluster.start_scheduler(lease_ttl_s=30.0, heartbeat_interval_s=0.1)
    await cluster.worker(REWARD)
    await cluster.worker(TRAINER, FakeTrainer())
    agents = [(await cluster.worker(ROLLOUT, r))[0] for r in rollouts]
    # announced to rollouts outside a weight group (a broadcast's ranks are each called)
    sections["trainer"] = {"weight_sync": "disk", **sections.get("trainer", {})}
    exp_id = await submit(cluster, spec(files, **sections))
    fleet = cluster.scheduler.get(exp_id).fleet
    ids = {a.worker_id for a in agents}
    registry = cluster.scheduler.registry
    await wait_until(lambda: fleet.ready == ids and all(registry.get(i).on_nats for i in ids), 10)
    return exp_id, agents


async def test_a_commit_is_one_message_and_every_rollout_answers_on_nats(cluster, files):
    rollouts = [FakeRollout() for _ in range(3)]
    exp_id, _ = await _running(cluster, files, rollouts)
    seen: list[str] = []
    rollout_nc = await connect(cluster.nats_url, identity="rollout")  # hears announcements
    scheduler_nc = await connect(cluster.nats_url, identity="scheduler")  # reads answers
    try:

        async def heard(msg) -> None:
            seen.append(msg.subject)

        await rollout_nc.subscribe(f"{WEIGHTS_ROOT}.>", cb=heard)
        await scheduler_nc.subscribe(f"{ACK_ROOT}.>", cb=heard)
        await rollout_nc.flush()
        await scheduler_nc.flush()
        await cluster.commit(exp_id, 1)
        fleet = cluster.scheduler.get(exp_id).fleet
        await wait_until(lambda: fleet.version == 1, 10)
        await asyncio.sleep(0.2)
    finally:
        await rollout_nc.close()
        await scheduler_nc.close()
    assert seen.count(f"{WEIGHTS_ROOT}.{exp_id}") == 1
    assert seen.count(f"{ACK_ROOT}.{exp_id}") == 3
    assert [r.via for r in rollouts] == [["rpc", "announcement"]] * 3  # the join, then v1
    assert [r.version for r in rollouts] == [1, 1, 1]
    assert len(fleet.ready) == 3 and fleet.last.updated == 3


async def test_a_rollout_that_does_not_answer_in_time_is_fenced(cluster, files):
    with capture_logs() as logs:
        quiet, fine = SilentRollout(), FakeRollout()
        exp_id, (q, f) = await _running(
            cluster, files, [quiet, fine], rollout={"weight_update_timeout_s": 1.0}
        )
        await cluster.commit(exp_id, 1)
        fleet = cluster.scheduler.get(exp_id).fleet
        await wait_until(lambda: fleet.version == 1, 10)
    assert _fenced(logs) == [
        (q.worker_id, "UpdateWeights v1 failed: no answer to the announcement within 1 s")
    ]
    assert fleet.ready == {f.worker_id} and fine.version == 1


async def test_an_answer_without_the_lease_key_is_no_answer(cluster, files):
    """Another rollout (same NATS user) answers for the silent one: refused, it is fenced."""
    with capture_logs() as logs:
        exp_id, (q,) = await _running(
            cluster, files, [SilentRollout()], rollout={"weight_update_timeout_s": 1.5}
        )
        forger = await connect(cluster.nats_url, identity="rollout")
        try:

            async def forge(msg) -> None:
                ann = scheduler_pb2.WeightsAnnouncement.FromString(msg.data)
                ack = scheduler_pb2.WeightsAck(
                    worker_id=q.worker_id,
                    lease_key="f" * 32,
                    experiment_id=ann.experiment_id,
                    version=ann.version,
                )
                await forger.publish(f"{ACK_ROOT}.{ann.experiment_id}", ack.SerializeToString())

            await forger.subscribe(f"{WEIGHTS_ROOT}.{exp_id}", cb=forge)
            await forger.flush()
            await cluster.commit(exp_id, 1)
            fleet = cluster.scheduler.get(exp_id).fleet
            await wait_until(lambda: fleet.version == 1, 10)
        finally:
            await forger.close()
    assert [w for w, _ in _fenced(logs)] == [q.worker_id]
    assert cluster.scheduler.announcer.refused == 1 and fleet.ready == set()


async def test_a_rollout_that_leaves_mid_round_is_answered_for_at_once(cluster, files):
    """A rollout that leaves while an announcement waits for it (a SIGTERM's hand-over) is
    answered for at once: the version reaches the fleet without waiting out the 30 s
    deadline, and the one that left is fenced with that reason."""
    with capture_logs() as logs:
        quiet, fine = SilentRollout(), FakeRollout()
        exp_id, (q, f) = await _running(
            cluster, files, [quiet, fine], rollout={"weight_update_timeout_s": 30.0}
        )
        commit = asyncio.create_task(cluster.commit(exp_id, 1))  # answered once the fleet is
        fleet = cluster.scheduler.get(exp_id).fleet
        await wait_until(lambda: fine.version == 1, 5)
        quiet_id = q.worker_id  # (its agent registers again once it is forgotten)
        cluster.scheduler.heartbeat(quiet_id, leaving=True)
        await wait_until(lambda: fleet.version == 1, 5)
        await commit
    assert _fenced(logs) == [(quiet_id, "UpdateWeights v1 failed: UNAVAILABLE: the rollout left")]


async def test_an_announcement_lost_on_the_way_goes_out_again(cluster, files, monkeypatch):
    """An announcement a rollout never got (published while its connection reconnected) goes
    out again to whoever has not answered: the version reaches the fleet in seconds, nobody is
    fenced, and the rollout that had answered answers the repeat from what it gave."""
    original = WeightsFollower._announced
    dropped: list[bytes] = []

    async def lossy(self, msg):
        if not dropped and self.agent.worker_id == lost_id[0]:
            dropped.append(msg.data)  # lost on the way
            return
        await original(self, msg)

    lost_id: list[str] = [""]
    monkeypatch.setattr(WeightsFollower, "_announced", lossy)
    with capture_logs() as logs:
        lossy_rollout, fine = FakeRollout(), FakeRollout()
        exp_id, (a, _) = await _running(
            cluster, files, [lossy_rollout, fine], rollout={"weight_update_timeout_s": 30.0}
        )
        lost_id[0] = a.worker_id
        await cluster.commit(exp_id, 1)
        fleet = cluster.scheduler.get(exp_id).fleet
        await wait_until(lambda: fleet.version == 1, 8)
    assert dropped and _fenced(logs) == []
    assert lossy_rollout.version == 1 and fine.updates[-1][0] == 1
    assert len([u for u in fine.updates if u[0] == 1]) == 1  # loaded once
