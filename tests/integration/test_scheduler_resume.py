"""ResumeExperiment against a real scheduler, nats-server and gRPC on port 0, with the fake
rollout and trainer of tests/fakes/scheduler_env.py: which states it refuses, and what a
resumed run dispatches (the groups cancelled in flight first, under their own ids, also after a
scheduler restart), with the ledger taking back what the end had called left over."""

from __future__ import annotations

import grpc
import pytest

from asyncrl.ledger import read_events, summarize
from asyncrl.natsutil import wait_until
from asyncrl.v1 import scheduler_pb2
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import (
    FakeRollout,
    FakeTrainer,
    running_experiment,
    spec,
    submit,
)

cluster = scheduler_env.cluster
files = scheduler_env.files


async def resume(cluster, exp_id: str, stub=None):
    request = scheduler_pb2.ResumeExperimentRequest(experiment_id=exp_id)
    return await (stub or cluster.stub).ResumeExperiment(request, timeout=10)


async def cancel(cluster, exp_id: str):
    request = scheduler_pb2.CancelExperimentRequest(experiment_id=exp_id)
    return await cluster.stub.CancelExperiment(request, timeout=10)


async def refused(cluster, exp_id: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await resume(cluster, exp_id)
    return info.value


async def test_resume_running_experiment_failed_precondition_names_state(cluster, files):
    await cluster.start_scheduler()
    exp_id = await running_experiment(cluster, files, FakeRollout(hold=True))
    e = await refused(cluster, exp_id)
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{exp_id} is RUNNING" in e.details() and "CANCELLED or FAILED" in e.details()


async def test_resume_pending_experiment_failed_precondition_names_state(cluster, files):
    await cluster.start_scheduler()
    exp_id = await submit(cluster, spec(files))  # no workers: it waits
    e = await refused(cluster, exp_id)
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{exp_id} is PENDING" in e.details()


async def test_resume_completed_experiment_failed_precondition_names_state(cluster, files):
    await cluster.start_scheduler()
    exp_id = await running_experiment(cluster, files, FakeRollout(), trainer={"total_steps": 1})
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.accepted >= 2)
    assert (await cluster.commit(exp_id, 1)).stop is True
    await wait_until(lambda: runner.terminal)
    e = await refused(cluster, exp_id)
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{exp_id} is COMPLETED" in e.details()
    assert (await cluster.experiment(exp_id)).state == scheduler_pb2.EXPERIMENT_STATE_COMPLETED


async def test_resume_unknown_experiment_not_found(cluster):
    await cluster.start_scheduler()
    e = await refused(cluster, "no-such-experiment")
    assert e.code() == grpc.StatusCode.NOT_FOUND


async def test_resume_as_viewer_permission_denied(cluster, files):
    await cluster.start_scheduler()
    exp_id = await submit(cluster, spec(files))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await resume(cluster, exp_id, stub=cluster.stub_as("viewer"))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("restart", [False, True])
async def test_resume_cancelled_redispatches_cancelled_groups_same_ids_first(
    cluster, files, restart
):
    """Cancel with two groups in flight; resume (after a scheduler restart too): the trainer is
    started again, the two groups go out first under their own ids, a second resume is
    refused as RUNNING, and the ledger no longer counts them left over."""
    await cluster.start_scheduler()
    rollout = FakeRollout(hold=True)
    trainer = FakeTrainer()
    exp_id = await running_experiment(
        cluster, files, rollout, fake_trainer=trainer, trainer={"total_steps": 10}
    )
    await wait_until(lambda: len(rollout.group_ids()) == 2)  # eta=0, B=2
    first = rollout.group_ids()
    exp = await cancel(cluster, exp_id)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_CANCELLED
    assert "2 prompts left over" in exp.message
    if restart:
        await cluster.scheduler.store.flush()
        await cluster.stop_scheduler()
        await cluster.start_scheduler(port=cluster.port)  # the workers register again
    exp = await resume(cluster, exp_id)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_PENDING
    assert exp.message.startswith("resumed from CANCELLED") or "waiting" in exp.message
    await wait_until(lambda: len(rollout.group_ids()) == 4, timeout=15)
    assert rollout.group_ids()[2:] == first
    assert trainer.started == [exp_id, exp_id]
    runner = cluster.scheduler.get(exp_id)
    assert runner.state.value == "RUNNING" and runner.record.cancelled == []
    e = await refused(cluster, exp_id)
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "is RUNNING" in e.details()
    rollout.release.set()  # the two are accepted; trained at v1
    await wait_until(lambda: runner.staleness.counts.accepted == 2)
    await cluster.commit(exp_id, 1)
    await runner.dispatcher.ledger.flush()
    events = await read_events(cluster.scheduler.js, exp_id)
    assert [e["event"] for e in events].count("resumed") == 1
    report = summarize(events)
    assert report.totals["left_over"] == 0, report.totals  # (the fake trainer records no step)
    again = [p for p in report.prompts if set(first) & set(p.groups)]
    assert [p.last_status for p in again] == ["accepted", "accepted"]


async def test_resume_failed_experiment_starts_the_trainer_from_its_checkpoint(cluster, files):
    """A run FAILED by its trainer (failed twice in a row) resumes once the trainer is fixed:
    StartExperiment again, at the version the trainer says it resumes from."""
    await cluster.start_scheduler(trainer_poll_interval_s=0.05, max_start_failures=2)
    trainer = FakeTrainer()
    rollout = FakeRollout(hold=True)
    exp_id = await running_experiment(
        cluster, files, rollout, fake_trainer=trainer, trainer={"total_steps": 10}
    )
    await wait_until(lambda: len(rollout.group_ids()) == 2)
    await cluster.commit(exp_id, 1)
    trainer.fail("ValueError: token id 99999 past the vocabulary")
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.terminal, timeout=10)
    assert (await cluster.experiment(exp_id)).state == scheduler_pb2.EXPERIMENT_STATE_FAILED
    trainer.failure, trainer.version, trainer.uri = "", 1, "file:///w/v1"  # its checkpoint
    exp = await resume(cluster, exp_id)
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_PENDING
    resumed = cluster.scheduler.get(exp_id)
    await wait_until(lambda: resumed.state.value == "RUNNING", timeout=10)
    assert trainer.started == [exp_id, exp_id, exp_id]
    assert resumed.version == 1 and resumed.committed_version == 1
    await wait_until(lambda: len(rollout.group_ids()) >= 4)  # dispatching again
