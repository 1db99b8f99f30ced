"""`trainer.weight_sync: broadcast` without `trainer.nccl_master`: the address of the trainer's
group store comes with each CommitWeights and reaches the rollouts' UpdateWeights through the
real scheduler (fake workers: tests/fakes/scheduler_env.py); a malformed one is refused at the
gRPC edge naming the field. Real nats-server, real gRPC."""

from __future__ import annotations

import grpc
import pytest

from asyncrl.natsutil import wait_until
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import FakeRollout, running_experiment

cluster = scheduler_env.cluster
files = scheduler_env.files

BROADCAST = {"weight_sync": "broadcast", "total_steps": 10}


def _update_to(rollout: FakeRollout, version: int):
    return next((r for r in rollout.update_requests if r.version == version), None)


async def test_committed_broadcast_store_reaches_the_rollouts_update_weights(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout()
    exp_id = await running_experiment(cluster, files, rollout, trainer=BROADCAST)
    await wait_until(lambda: rollout.update_requests)  # v0 from the spec's model: no group
    assert rollout.update_requests[0].broadcast_store == ""
    assert rollout.update_requests[0].group_rank == 0
    await cluster.commit(exp_id, 1, broadcast_store="10.1.2.3:41234")
    await wait_until(lambda: _update_to(rollout, 1) is not None)
    got = _update_to(rollout, 1)
    assert (got.group_rank, got.group_size) == (1, 1)
    assert got.broadcast_store == "10.1.2.3:41234"
    # a restarted trainer hosts its store on another port: its next commit says so
    await cluster.commit(exp_id, 2, broadcast_store="10.1.2.3:50001")
    await wait_until(lambda: _update_to(rollout, 2) is not None)
    assert _update_to(rollout, 2).broadcast_store == "10.1.2.3:50001"


async def test_disk_experiment_update_weights_carry_no_store(cluster, files):
    await cluster.start_scheduler()
    rollout = FakeRollout()
    trainer = {"total_steps": 10, "weight_sync": "disk"}
    exp_id = await running_experiment(cluster, files, rollout, trainer=trainer)
    await wait_until(lambda: rollout.update_requests)
    await cluster.commit(exp_id, 1, broadcast_store="10.1.2.3:41234")
    await wait_until(lambda: _update_to(rollout, 1) is not None)
    got = _update_to(rollout, 1)
    assert (got.group_rank, got.broadcast_store) == (0, "")


@pytest.mark.parametrize(
    ("address", "details"),
    [
        ("10.1.2.3", "broadcast_store: '10.1.2.3' is not host:port (port 1-65535)"),
        ("10.1.2.3:0", "broadcast_store: '10.1.2.3:0' is not host:port (port 1-65535)"),
        ("h:65536", "broadcast_store: 'h:65536' is not host:port (port 1-65535)"),
        ("a b:1", "broadcast_store: 'a b:1' is not host:port (port 1-65535)"),
        ("x" * 600, "broadcast_store: 'xxxx"),
    ],
)
async def test_commit_bad_broadcast_store_invalid_argument_names_it(
    cluster, files, address, details
):
    await cluster.start_scheduler()
    rollout = FakeRollout()
    exp_id = await running_experiment(cluster, files, rollout, trainer=BROADCAST)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await cluster.commit(exp_id, 1, broadcast_store=address)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(details)
    assert cluster.scheduler.get(exp_id).committed_version == 0  # nothing recorded
