"""A drop the trainer re-reports after a scheduler restart is idempotent (issue 23 point 11):
the restarted scheduler derives that the group's prompt was handled, answers OK and counts
nothing twice; an id it cannot have dispatched stays INVALID_ARGUMENT. Real nats-server, real
gRPC, the scheduler restarted for real."""

from __future__ import annotations

import grpc
import pytest

from asyncrl.natsutil import wait_until
from asyncrl.v1 import scheduler_pb2
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import FakeRollout, running_experiment

cluster = scheduler_env.cluster
files = scheduler_env.files


def dropped(exp_id: str, *group_ids: str) -> scheduler_pb2.ReportDroppedRequest:
    return scheduler_pb2.ReportDroppedRequest(
        experiment_id=exp_id, groups=[scheduler_pb2.DroppedGroup(group_id=g) for g in group_ids]
    )


async def test_drop_re_reported_after_scheduler_restart_ok_counted_once(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout()
    exp_id = await running_experiment(cluster, files, rollout, trainer={"total_steps": 10})
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.accepted == 2)
    first = rollout.group_ids()[0]  # dataset not shuffled: {exp}-e0-p0-a0
    await cluster.trainer_stub.ReportDropped(dropped(exp_id, first), timeout=5)
    await wait_until(lambda: len(rollout.group_ids()) == 3)  # re-dispatched as attempt 1
    await cluster.scheduler.store.flush()
    await cluster.stop_scheduler()
    await cluster.start_scheduler(port=cluster.port)
    await wait_until(lambda: exp_id in cluster.scheduler.runners, timeout=5)
    runner = cluster.scheduler.get(exp_id)
    before = (await cluster.experiment(exp_id)).progress.stale_dropped
    assert before == 1
    # the rewound trainer reports it again: today "is no training group" (BadRequest)
    await cluster.trainer_stub.ReportDropped(dropped(exp_id, first), timeout=5)
    assert (await cluster.experiment(exp_id)).progress.stale_dropped == 1  # not counted again


@pytest.mark.parametrize(
    "suffix",
    ["-e0-p19-a0", "-e1-p0-a0", "-e0-p20-a0", "-eval-v0-p0-a0"],
    ids=["prompt-not-reached", "epoch-not-reached", "no-such-row", "eval-group"],
)
async def test_drop_of_a_group_never_dispatched_invalid_argument(cluster, files, suffix):
    await cluster.start_scheduler()
    rollout = FakeRollout()
    exp_id = await running_experiment(cluster, files, rollout, trainer={"total_steps": 10})
    await wait_until(lambda: cluster.scheduler.get(exp_id).staleness.counts.accepted == 2)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await cluster.trainer_stub.ReportDropped(dropped(exp_id, exp_id + suffix), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == (
        f"groups: '{exp_id}{suffix}' is no training group of {exp_id} that was accepted or is"
        " in flight"
    )
