"""FairSlots: the reward service's processes shared between experiments, each capped at
ceil(slots / active experiments) and served round-robin (services/reward/fair.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.reward.fair import ACTIVE_S, FairSlots, NotStarted


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _take(slots: FairSlots, key: str, order: list[str]) -> None:
    await slots.acquire(key)
    order.append(key)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_one_experiment_alone_may_hold_every_slot():
    slots = FairSlots(2, clock=Clock())
    await slots.acquire("a")
    await slots.acquire("a")
    assert (slots.cap(), slots.free, dict(slots.held)) == (2, 0, {"a": 2})


async def test_two_active_experiments_hold_one_of_two_slots_each():
    clock = Clock()
    slots = FairSlots(2, clock=clock)
    slots.touch("b")  # bound: b's share is kept for it
    await slots.acquire("a")
    order: list[str] = []
    second_a = asyncio.create_task(_take(slots, "a", order))
    await _settle()
    assert order == [] and slots.cap() == 1  # ceil(2 / 2): a waits although a slot is free
    await slots.acquire("b")  # at once: b's slot was free
    assert dict(slots.held) == {"a": 1, "b": 1}
    slots.release("a")
    await _settle()
    assert order == ["a"]
    await second_a


async def test_an_idle_experiment_frees_its_share_after_active_s():
    clock = Clock()
    slots = FairSlots(2, clock=clock)
    slots.touch("b")
    await slots.acquire("a")
    assert slots.cap() == 1
    clock.now += ACTIVE_S + 1
    assert slots.cap() == 2
    await asyncio.wait_for(slots.acquire("a"), 1)


async def test_freed_slots_go_round_robin_between_waiting_experiments():
    slots = FairSlots(1, clock=Clock())
    await slots.acquire("a")
    order: list[str] = []
    tasks = [asyncio.create_task(_take(slots, k, order)) for k in ("a", "a", "a", "b", "c")]
    await _settle()
    for _ in range(5):
        slots.release(order[-1] if order else "a")
        await _settle()
    # a's first waiter came first; then b and c each get a turn before a's next waiters
    assert order == ["a", "b", "c", "a", "a"]
    await asyncio.gather(*tasks)


async def test_no_slot_by_start_by_is_not_started_and_leaves_no_waiter():
    slots = FairSlots(1)  # the real clock: the wait is real
    await slots.acquire("a")
    with pytest.raises(NotStarted, match=r"waited 0\.\ds for a scoring process"):
        await slots.acquire("a", start_by=time.monotonic() + 0.05)
    slots.release("a")
    assert (slots.free, dict(slots.held)) == (1, {})


async def test_a_cancelled_waiter_gives_its_turn_on():
    slots = FairSlots(1, clock=Clock())
    await slots.acquire("a")
    order: list[str] = []
    waiting = asyncio.create_task(_take(slots, "b", order))
    after = asyncio.create_task(_take(slots, "c", order))
    await _settle()
    waiting.cancel()
    await _settle()
    slots.release("a")
    await _settle()
    assert order == ["c"] and dict(slots.held) == {"c": 1}
    await after
