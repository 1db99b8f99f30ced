"""The trainer's commit path while NATS is away: a real trainer (tiny model, torch backend) on
a real nats-server that is stopped for a while right as the scheduler answers a commit. The
commit is answered over gRPC; the step's `trained` ledger event (a JetStream write) must not
hold the training loop for the outage (it did: the next version was committed only once NATS
was back, and an outage over 60 s failed the trainer)."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.ledger import read_events
from asyncrl.natsutil import publish_group, wait_until
from asyncrl.v1 import trainer_pb2
from services.trainer.checkpoint import checkpoint_root, latest_checkpoint
from tests.fakes import trainer_env
from tests.fakes.trainer_env import EXP, RecordingScheduler, _group, _spec, _wait_acked

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

start_trainer = trainer_env.start_trainer
OUTAGE_S = 8.0


class OutageScheduler(RecordingScheduler):
    """Calls `before_answer(request)` before answering a CommitWeights."""

    before_answer = None

    async def CommitWeights(self, request, context):
        if self.before_answer is not None:
            await self.before_answer(request)
        return await super().CommitWeights(request, context)


@pytest.fixture
async def scheduler(js):
    """The recording scheduler with a hook before each answer (`start_trainer` uses it)."""
    from asyncrl.ledger import ensure_ledger

    await ensure_ledger(js)
    async with trainer_env.serving(OutageScheduler()) as servicer:
        yield servicer


async def test_trainer_commits_on_while_nats_is_away_ledger_written_once_back(
    tiny, nats_server, scheduler, start_trainer, js, tmp_path
):
    service, stub = await start_trainer()
    spec = _spec(tiny[0], eta=1, checkpoint_every=2)
    await stub.StartExperiment(
        trainer_pb2.StartExperimentRequest(experiment_id=EXP, spec_json=spec), timeout=60
    )
    for i in range(4):  # two steps; eta 1: step 2 may train groups of version 0
        await publish_group(js, _group(tiny, f"g{i}", 0))
    outage: dict[str, float] = {}

    async def nats_away_at_the_first_commit(request) -> None:
        if request.version != 1 or outage:
            return
        await _wait_acked(js, 4)  # the trainer holds step 2's groups: it can go on without NATS
        await asyncio.to_thread(nats_server.stop)
        outage["stopped"] = time.monotonic()

        async def back_later() -> None:
            await asyncio.sleep(OUTAGE_S)
            await asyncio.to_thread(nats_server.start)
            outage["back"] = time.monotonic()

        outage["task"] = asyncio.ensure_future(back_later())

    scheduler.before_answer = nats_away_at_the_first_commit
    await wait_until(lambda: len(scheduler.commits) >= 2, timeout=OUTAGE_S + 30)
    committed_v2 = time.monotonic() - outage["stopped"]
    assert "back" not in outage, f"v2 committed {committed_v2:.1f}s into the outage, after it"
    assert committed_v2 < OUTAGE_S / 2, committed_v2
    # the checkpoint at step 2 is not written ahead of the ledger (its trained events wait)
    assert latest_checkpoint(checkpoint_root(tmp_path / "var", EXP)) is None
    await outage["task"]
    await wait_until(lambda: service.ledger.unstored == 0, timeout=30)
    trained = [e for e in await read_events(js, EXP) if e["event"] == "trained"]
    assert [(e["step"], e["version"]) for e in trained] == [(1, 1), (2, 2)]
    assert service.state.value != "failed", service.message
