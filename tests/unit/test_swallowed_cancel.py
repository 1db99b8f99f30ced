"""Long-lived loops end on a cancel that one of their awaits swallowed. Python 3.11's
`asyncio.wait_for` (which nats-py's calls and the trainer watchdog's poll use) can return a
result for a cancel that comes as its future completes; a loop that starts another pass then
runs on, and whoever cancelled it waits forever (a scheduler's shutdown hung that way)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from asyncrl.ledger import Ledger
from asyncrl.logging import get_logger, keep_running
from services.scheduler.lifecycle import Phase
from services.scheduler.supervisor import TrainerSupervisor
from services.trainer.service import TrainerService


def swallowing_once(result):
    """An async call whose first await swallows a cancel, as that wait_for does."""
    calls = []

    async def call(*_):
        calls.append(len(calls))
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if len(calls) > 1:
                raise
        return result

    return call, calls


async def test_keep_running_ends_on_a_cancel_that_a_pass_swallowed():
    """The scheduler's state flusher, lease renewer and history writer run this way."""
    body, calls = swallowing_once(None)
    task = asyncio.create_task(keep_running("test", body, get_logger()))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert calls == [0]


async def test_the_trainer_watchdog_ends_on_a_cancel_its_poll_swallowed():
    watchdog = TrainerSupervisor.__new__(TrainerSupervisor)
    watchdog._poll_now = asyncio.Event()
    watchdog.config = SimpleNamespace(trainer_poll_interval_s=0.001)
    watchdog.lifecycle = SimpleNamespace(phase=Phase.RUNNING)
    watchdog._check_trainer, calls = swallowing_once(("", ""))
    watchdog._check_progress = lambda *_: ("", "")
    task = asyncio.create_task(watchdog.watch(lambda: ((), ""), lambda why, fail: None))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert calls == [0]


async def test_the_ledger_writer_ends_on_a_cancel_a_publish_swallowed():
    """NATS away: the writer tries again and again; a cancel that one try swallowed ends it."""
    publish, calls = swallowing_once(None)

    async def failing_publish(*args, **kwargs):
        await publish()
        raise TimeoutError("nats away")

    ledger = Ledger(SimpleNamespace(publish=failing_publish), "test")
    ledger.emit("started")
    task = ledger._writer
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert calls == [0]


async def test_the_trainer_loop_ends_on_a_cancel_a_pull_swallowed():
    """`close(checkpoint=False)` cancels the loop while it waits for groups; a pull that
    swallowed the cancel must not be followed by another (a trainer test's teardown hung)."""
    pull, calls = swallowing_once([])
    trainer = TrainerService.__new__(TrainerService)
    trainer.spec = SimpleNamespace(trainer=SimpleNamespace(batch_size=2))
    trainer._boundary_seq, trainer.fetch_timeout_s = 0, 0.01
    trainer._stop = asyncio.Event()
    trainer.publisher = SimpleNamespace(done=False)
    trainer._consumer = SimpleNamespace(pull=lambda n, timeout: pull())
    task = asyncio.create_task(trainer._collect())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert calls == [0]
