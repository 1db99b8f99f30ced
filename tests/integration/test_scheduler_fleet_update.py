"""CommitWeights off the fleet's critical path: the scheduler answers once the version is
recorded, the ready rollouts load it in the background (coalescing commits that land during an
update), and the staleness rule holds meanwhile: admission follows the fleet version, stale
aborts the committed one, no training group starts while the fleet is behind the trainer, and
a commit is answered once the fleet is at most `fleet_lag` (eta - 1, at most 1) behind. Real
scheduler on port 0 against a real nats-server; fake workers (tests/fakes/scheduler_env.py)."""

from __future__ import annotations

import asyncio

from asyncrl.natsutil import wait_until
from asyncrl.v1 import scheduler_pb2
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import (
    Cluster,
    FakeRollout,
    FakeTrainer,
    running_experiment,
)

cluster = scheduler_env.cluster
files = scheduler_env.files


class GatedRollout(FakeRollout):
    """UpdateWeights to any version but 0 waits until `gate` is set (a slow weight load);
    `held` lists the versions that came to the gate."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = asyncio.Event()
        self.held: list[int] = []

    async def UpdateWeights(self, request, context):
        if request.version > 0:
            self.held.append(request.version)
            await self.gate.wait()
        return await super().UpdateWeights(request, context)


async def test_commit_answered_before_the_fleet_loads_it_lag_bounded_updates_coalesce(
    cluster: Cluster, files
):
    await cluster.start_scheduler()
    rollout = GatedRollout()
    exp_id = await running_experiment(
        cluster,
        files,
        rollout,
        fake_trainer=FakeTrainer(),
        rollout={"max_head_offpolicyness": 2},
        trainer={"total_steps": 10},
    )
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.accepted >= 2)
    resp = await cluster.commit(exp_id, 1)  # the fleet's update to 1 is stuck: answered anyway
    assert (resp.fleet_version, resp.stop) == (0, False)
    assert (runner.committed_version, runner.version) == (1, 0)
    assert (await cluster.experiment(exp_id)).progress.version == 0  # what admission uses
    # version 2 is recorded at once, but answered only once the fleet serves 1 (the trainer may
    # run one version ahead of the fleet, no more); 3 lands meanwhile
    second = asyncio.create_task(cluster.commit(exp_id, 2))
    await wait_until(lambda: runner.committed_version == 2)
    third = asyncio.create_task(cluster.commit(exp_id, 3))
    await wait_until(lambda: runner.committed_version == 3 and rollout.held == [1])
    assert not second.done() and not third.done()
    rollout.gate.set()
    # each answer carries the fleet version it was given at: 2 waited for the fleet to serve 1
    # (a lag of 1), 3 for 3 (the update it coalesced into)
    assert (await second).fleet_version >= 1
    assert (await third).fleet_version == 3
    assert [v for v, _ in rollout.updates] == [0, 1, 3]  # 2 was coalesced into 3
    assert rollout.updates[-1] == (3, "file:///w/v3")


async def test_fleet_behind_the_trainer_starts_no_training_group(cluster: Cluster, files):
    await cluster.start_scheduler()
    rollout = GatedRollout()
    exp_id = await running_experiment(
        cluster, files, rollout, fake_trainer=FakeTrainer(), trainer={"total_steps": 10}
    )  # eta = 0, B = 2: the fleet may not lag, a commit is answered once it serves the version
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.accepted == 2)
    await asyncio.wait_for(runner.settled(), 5)
    commit = asyncio.create_task(cluster.commit(exp_id, 1))
    await wait_until(lambda: runner.committed_version == 1)
    # a drop frees capacity at the fleet's v0, but the trainer is at v1: a group started now
    # would be stale before it is read, so none is
    dropped = scheduler_pb2.DroppedGroup(group_id=rollout.group_ids()[0])
    await cluster.trainer_stub.ReportDropped(
        scheduler_pb2.ReportDroppedRequest(experiment_id=exp_id, groups=[dropped]), timeout=5
    )
    await asyncio.wait_for(runner.settled(), 5)
    assert runner.staleness.capacity() == 1 and runner.version == 0
    assert len(rollout.group_ids()) == 2 and not commit.done()
    rollout.gate.set()  # the fleet reaches v1: answered; training groups start again, at v1
    assert (await commit).fleet_version == 1
    await wait_until(lambda: len(rollout.group_ids()) == 5)  # (0 + 1 + 1) * 2 - 1
    assert rollout.served[2:] == [1, 1, 1]
