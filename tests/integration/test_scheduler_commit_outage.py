"""A commit while nats-server is down: the scheduler cannot store the record that holds the
version, so it answers UNAVAILABLE at once (the trainer retries the same version), never OK
for a version it could lose, and never after waiting out a write's timeout. Real nats-server,
stopped and started again; real gRPC."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from asyncrl.natsutil import wait_until
from tests.fakes import scheduler_env
from tests.fakes.scheduler_env import FakeRollout, running_experiment

cluster = scheduler_env.cluster
files = scheduler_env.files


async def test_commit_nats_down_unavailable_at_once_retry_stored_after(cluster, files, nats_server):
    await cluster.start_scheduler()
    exp_id = await running_experiment(cluster, files, FakeRollout(), trainer={"total_steps": 10})
    runner = cluster.scheduler.get(exp_id)
    await wait_until(lambda: runner.staleness.counts.accepted >= 2)
    nats_server.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await cluster.commit(exp_id, 1)
        took = time.monotonic() - t0
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert took < 2.0, took
    finally:
        nats_server.start()
    deadline = time.monotonic() + 30
    while True:  # as the trainer does: the same version again until it is answered
        try:
            answer = await cluster.commit(exp_id, 1)
            break
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            assert time.monotonic() < deadline, "NATS back, the commit still refused"
            await asyncio.sleep(0.2)
    assert not answer.stop
    (record,) = [r for r in await cluster.scheduler.store.load_all() if r.id == exp_id]
    assert record.progress.version == 1  # stored before the trainer heard back
