"""Infrastructure faults around the scheduler are retried under the same group id and counted
once: a lost GenerateGroup reply after the publish, a scheduler restart with groups in flight,
a rollout frozen across a weight update. Real nats-server and JetStream, real gRPC; the
rollout fakes publish each group to the trajectory stream as the real one does."""

from __future__ import annotations

import asyncio

import grpc

from asyncrl.natsutil import STREAM, publish_group, wait_until
from asyncrl.types import TrajectoryGroup
from asyncrl.v1 import rollout_pb2
from services.rollout.server import GroupCallError
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import (
    ROLLOUT,
    FakeRollout,
    FakeTrainer,
    running_experiment,
)

cluster = scheduler_env.cluster
files = scheduler_env.files


class PublishingRollout(FakeRollout):
    """Publishes each training group to JetStream (Nats-Msg-Id = group id) before answering,
    and reports the PubAck's duplicate flag. The first `lose_replies` groups are published,
    then their answer is lost (the call fails). With `hold`, a published group's answer waits for
    `release` (a scheduler killed meanwhile never gets it)."""

    def __init__(self, js, **kw):
        super().__init__(**kw)
        self.js = js
        self.lose_replies = 0
        self.duplicates: list[str] = []

    async def _group(self, request):
        self.requests.append(request)
        if request.eval:
            return rollout_pb2.GroupSummary(
                group_id=request.group_id, status=rollout_pb2.GROUP_STATUS_ACCEPTED
            )
        group = TrajectoryGroup(
            experiment_id=request.experiment_id,
            group_id=request.group_id,
            prompt_id=request.prompt_id,
            prompt=request.prompt,
            answer=request.answer,
            prompt_ids=[1],
            samples=[],
        )
        _, duplicate = await publish_group(self.js, group)
        if duplicate:
            self.duplicates.append(request.group_id)
        if self.lose_replies:
            self.lose_replies -= 1
            raise GroupCallError(grpc.StatusCode.UNAVAILABLE, "connection reset (reply lost)")
        if self.hold:
            await self.release.wait()
        return rollout_pb2.GroupSummary(
            group_id=request.group_id,
            status=rollout_pb2.GROUP_STATUS_ACCEPTED,
            rewards=self.rewards,
            published=True,
            duplicate=duplicate,
        )


class RewardlessRollout(FakeRollout):
    """Answers its first group as a rollout whose reward services were all unreachable."""

    async def _group(self, request):
        if not self.requests:
            self.requests.append(request)
            raise GroupCallError(
                grpc.StatusCode.UNAVAILABLE,
                "reward service 127.0.0.1:1: UNAVAILABLE: connection refused",
                "reward-unavailable",
            )
        return await super()._group(request)


class FrozenRollout(FakeRollout):
    """Takes version 0, then never answers an UpdateWeights (a SIGSTOPped process)."""

    async def UpdateWeights(self, request, context):
        if request.version > 0:
            await asyncio.Event().wait()
        return await super().UpdateWeights(request, context)


async def stream_messages(js) -> int:
    return (await js.stream_info(STREAM)).state.messages


async def test_lost_reply_after_publish_retried_under_same_group_id(cluster, files, js):
    await cluster.start_scheduler(lease_ttl_s=0.5, heartbeat_interval_s=0.1)
    rollout = PublishingRollout(js)
    rollout.lose_replies = 1
    exp_id = await running_experiment(cluster, files, rollout, trainer={"total_steps": 10})
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.accepted == 2, timeout=10)
    first = rollout.group_ids()[0]
    # the fenced rollout comes back and gets the prompt again, under the same id: JetStream
    # stores it once and the answer says so (the fence may also have cut the other group's
    # answer after its publish: the same holds for it)
    assert rollout.group_ids().count(first) == 2
    assert first in rollout.duplicates
    await asyncio.wait_for(runner.settled(), 5)
    assert await stream_messages(js) == runner.staleness.counts.accepted == 2


async def test_scheduler_restart_counts_republished_inflight_groups_once(cluster, files, js):
    await cluster.start_scheduler()
    rollout = PublishingRollout(js, hold=True)
    trainer = FakeTrainer()
    exp_id = await running_experiment(cluster, files, rollout, trainer, trainer={"total_steps": 10})
    await wait_until(lambda: len(rollout.group_ids()) == 2)
    await cluster.scheduler.store.flush()  # persisted: 0 accepted, these 2 in flight
    await cluster.stop_scheduler()  # their answers are lost with it
    # meanwhile the trainer trained both published groups: it resumes at version 1
    trainer.version, trainer.uri = 1, "file:///w/v1"
    rollout.release.set()
    await cluster.start_scheduler(port=cluster.port)
    await wait_until(lambda: exp_id in cluster.scheduler.runners, timeout=5)
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: len(rollout.duplicates) == 2, timeout=15)
    # (eta + v + 1) * B = 4 admitted at v1: the re-dispatched pair, then two new groups
    await wait_until(
        lambda: (runner.staleness.counts.accepted, runner.staleness.counts.running) == (4, 0)
    )
    await asyncio.wait_for(runner.settled(), 5)
    # every accepted group is one message in the stream: the re-dispatched pair counted once
    assert runner.staleness.counts.accepted == await stream_messages(js) == 4


async def test_reward_unavailable_group_retried_same_id_rollout_not_fenced(cluster, files):
    await cluster.start_scheduler()
    rollout = RewardlessRollout()
    exp_id = await running_experiment(cluster, files, rollout, trainer={"total_steps": 10})
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.accepted == 2, timeout=10)
    first = rollout.group_ids()[0]
    assert rollout.group_ids().count(first) == 2  # retried under the same id
    exp = await cluster.experiment(exp_id)
    assert (exp.progress.failed, exp.progress.requeued) == (0, 1)
    assert (len(rollout.bound), len(rollout.updates)) == (1, 1)  # never fenced and re-bound
    assert [w.worker_id for w in runner.rollouts()] == list(runner.fleet.ready)


async def test_frozen_rollout_fenced_at_weight_update_deadline_commit_completes(cluster, files):
    await cluster.start_scheduler(lease_ttl_s=60.0)  # the lease cannot be what fences it
    healthy = FakeRollout()
    exp_id = await running_experiment(
        cluster, files, healthy, rollout={"weight_update_timeout_s": 0.5}
    )
    frozen = FrozenRollout()
    await cluster.worker(ROLLOUT, frozen)
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: len(runner.fleet.ready) == 2, timeout=10)
    resp = await cluster.commit(exp_id, 1)
    # at eta 0 answered once the fleet serves it: the update waited out the frozen one's deadline
    assert resp.fleet_version == 1
    assert healthy.version == 1
    [left] = runner.rollouts()  # the frozen one is unbound, its lease still valid
    assert runner.fleet.ready == {left.worker_id}
