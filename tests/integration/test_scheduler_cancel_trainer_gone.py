"""A run cancelled while its trainer does not answer StopExperiment (frozen) and then leaves or
lets its lease lapse: the trainer's channel is closed under the pending call, which raises
CancelledError in the caller. The cancel must still end the run CANCELLED and answer, not
stay in ENDING with the client waiting out its deadline. Real nats-server, real gRPC."""

from __future__ import annotations

import asyncio
import time

from asyncrl.natsutil import wait_until
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


class FrozenStopTrainer(FakeTrainer):
    """Answers everything but StopExperiment, which never returns."""

    async def StopExperiment(self, request, context):
        await asyncio.Event().wait()


async def test_cancel_trainer_frozen_then_gone_run_cancelled_and_answered(cluster, files):
    scheduler = await cluster.start_scheduler()
    await cluster.worker(REWARD)
    trainer, _ = await cluster.worker(TRAINER, FrozenStopTrainer())
    await cluster.worker(ROLLOUT, FakeRollout())
    exp_id = await submit(cluster, spec(files, trainer={"total_steps": 10}))
    runner = scheduler.get(exp_id)
    await wait_until(lambda: runner.state.value == "RUNNING", 10)
    request = scheduler_pb2.CancelExperimentRequest(experiment_id=exp_id)
    t0 = time.monotonic()

    async def cancel_call():
        return await cluster.stub.CancelExperiment(request, timeout=30)

    cancel = asyncio.create_task(cancel_call())
    await wait_until(lambda: runner.lifecycle.phase.name == "ENDING", 10)
    await asyncio.sleep(0.2)  # StopExperiment sent, pending
    await trainer.leave()  # the scheduler closes the trainer's channel
    exp = await cancel
    assert time.monotonic() - t0 < 15  # at most the trainer's stop timeout (10 s)
    assert runner.state.value == "CANCELLED"
    assert exp.state == scheduler_pb2.EXPERIMENT_STATE_CANCELLED
