"""ScoringPool with its real process pool: where items are scored, and that a batch task's
failure never spreads to the neighbours of the item that caused it."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.rewards import INLINE_MAX_CHARS
from asyncrl.types import RewardStatus, Score, ScoreItem
from services.reward.pool import ScoringPool, score_items

SCRIPTED = "plugin:tests.fixtures_plugins.rewards:scripted"
FAILED = RewardStatus.FAILED


@pytest.fixture
async def pool():
    p = ScoringPool(workers=2)
    yield p
    await p.close()


def _items(*completions: str, answer: str = "1") -> list[ScoreItem]:
    return [
        ScoreItem(id=f"i{k}", prompt="p", completion=c, answer=answer)
        for k, c in enumerate(completions)
    ]


async def test_score_inline_builtin_needs_no_pool_process(pool):
    await pool.close()  # any item sent to the pool now fails
    got = await pool.score("exact_match", {}, _items("1", " 1 ", "2"), timeout_s=1)
    assert got == [Score(1.0), Score(1.0), Score(0.0)]
    numeric = await pool.score("numeric_match", {}, _items("it is 1.0", "x"), timeout_s=1)
    assert numeric == [Score(1.0), Score(0.0)]


async def test_score_inline_builtin_raises_that_item_failed_with_reason(pool):
    await pool.close()  # inline: no pool process
    items = [
        *_items("1"),
        ScoreItem(id="bad", prompt="p", completion="1", answer="no digits"),
        *_items("2"),
    ]
    assert await pool.score("numeric_match", {}, items, timeout_s=1) == [
        Score(1.0),
        Score(0.0, FAILED, "ValueError: answer has no number: 'no digits'"),
        Score(0.0),
    ]
    bad_kwarg = await pool.score("exact_match", {"case_sensitive": "x"}, _items("1"), timeout_s=1)
    assert bad_kwarg == [
        Score(0.0, FAILED, "ValueError: kwarg 'case_sensitive' must be 'true' or 'false', got 'x'")
    ]


async def test_score_inline_builtin_long_text_goes_to_pool(pool):
    long = "x " * INLINE_MAX_CHARS + "1"
    assert await pool.score("numeric_match", {}, _items(long, "1"), timeout_s=5) == [
        Score(1.0),
        Score(1.0),
    ]
    await pool.close()
    [long_result, short] = await pool.score("numeric_match", {}, _items(long, "1"), timeout_s=5)
    assert long_result.status is FAILED and short == Score(1.0)


async def _known_cheap(pool) -> None:
    """Score two quick items: SCRIPTED is then known cheap, and batched."""
    assert await pool.score(SCRIPTED, {}, _items("ok", "ok"), timeout_s=5) == [Score(1.0)] * 2


async def test_score_batch_hanging_item_fails_alone(pool):
    await _known_cheap(pool)
    items = _items("ok", "sleep 30", "raise", "ok", answer="0.5")
    start = time.monotonic()
    got = await pool.score(SCRIPTED, {}, items, timeout_s=0.4)
    assert got == [
        Score(0.5),
        Score(0.0, FAILED, "timed out after 0.4s"),
        Score(0.0, FAILED, "ValueError: scripted failure"),
        Score(0.5),
    ]
    assert time.monotonic() - start < 5  # the hung item stopped at 0.4 s, the rest go on
    assert pool.in_flight == 0


async def test_score_batch_worker_exit_fails_that_item_only(pool):
    await _known_cheap(pool)
    got = await pool.score(SCRIPTED, {}, _items("ok", "exit", "ok", answer="2"), timeout_s=5)
    assert got == [Score(2.0), Score(0.0, FAILED, "worker died (exit code 3)"), Score(2.0)]


async def test_score_batch_slow_item_times_out_rest_scored_in_next_task(pool):
    await _known_cheap(pool)
    got = await pool.score(SCRIPTED, {}, _items("sleep 0.5", "ok", "ok"), timeout_s=0.3)
    assert got == [Score(0.0, FAILED, "timed out after 0.3s"), Score(1.0), Score(1.0)]


def test_score_items_stops_starting_items_after_timeout():
    items = _items("sleep 0.2", "ok", "ok")
    [(ok, reason, seconds)] = score_items(SCRIPTED, {}, items, timeout_s=0.1)
    assert (ok, reason) == (False, "timed out after 0.1s")
    assert 0.1 <= seconds < 0.2  # stopped by its alarm at 0.1 s, not run to its end
    outcomes = score_items(SCRIPTED, {}, items[1:], timeout_s=0.1)
    assert [(ok, value) for ok, value, _ in outcomes] == [(True, 1.0), (True, 1.0)]


@pytest.fixture
async def one_worker():
    p = ScoringPool(workers=1)
    yield p
    await p.close()


async def _timed(pool, completions, timeout_s: float) -> tuple[list[Score], float]:
    start = time.monotonic()
    got = await pool.score(SCRIPTED, {}, _items(*completions), timeout_s=timeout_s)
    return got, time.monotonic() - start


async def test_score_never_seen_function_hanging_holds_the_slot_its_timeout_only(one_worker):
    got, took = await _timed(one_worker, ["sleep 30", "sleep 30"], timeout_s=1.5)
    assert got == [Score(0.0, FAILED, "timed out after 1.5s")] * 2
    # each item killed at its own 1.5 s (the second one in the spare process, once the first
    # turned suspect). Batched first (before), the pair held the worker 2 x 1.5 + 0.5 s, then
    # each item again for 1.5 s: 6.5 s
    assert took >= 1.5
    got, took = await _timed(one_worker, ["ok"], timeout_s=1.5)
    assert got == [Score(1.0)] and took < 1.0  # the slot is free again
    assert one_worker.in_flight == 0


async def test_score_batch_that_hung_function_scored_per_item_from_then_on(one_worker):
    await _known_cheap(one_worker)
    got, _ = await _timed(one_worker, ["sleep 30", "ok"], timeout_s=1.0)  # the batch hangs
    assert got == [Score(0.0, FAILED, "timed out after 1s"), Score(1.0)]
    got, took = await _timed(one_worker, ["sleep 30", "ok"], timeout_s=1.0)
    assert got == [Score(0.0, FAILED, "timed out after 1s"), Score(1.0)]
    # per item: the hung one killed at 1 s. Batched again (before): 2 x 1 + 0.5 s, then 1 s
    assert took < 2.4


async def test_score_hung_item_holds_back_its_experiments_good_items_its_timeout_only(one_worker):
    """One process, a known-cheap function (batched), one experiment: a Score call whose first
    item hangs and another call of the same experiment with good items only. Every good item
    is answered within the hung item's timeout (1 s) and a little: the worker stops the hung
    item at its own timeout and goes on. Before, the batch task was killed at 2 x 1 + 0.5 s
    and its items all scored again one by one, the hung one first: the hung call took 3.5 s,
    the other call 2.5 s."""
    await _known_cheap(one_worker)

    async def timed_call(*completions: str) -> tuple[list[Score], float]:
        start = time.monotonic()
        got = await one_worker.score(SCRIPTED, {}, _items(*completions), 1.0, key="exp")
        return got, time.monotonic() - start

    (hung, hung_s), (good, good_s) = await asyncio.gather(
        timed_call("sleep 30", "ok", "ok"), timed_call("ok", "ok")
    )
    assert hung == [Score(0.0, FAILED, "timed out after 1s"), Score(1.0), Score(1.0)]
    assert good == [Score(1.0), Score(1.0)]
    assert hung_s < 1.6 and good_s < 1.6, (hung_s, good_s)
    assert one_worker.in_flight == 0


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-by-one"])
async def test_hung_item_does_not_hold_back_its_experiments_other_calls(one_worker, batched):
    """One process for scoring, one experiment: a Score call whose item hangs (timeout 4 s)
    and, once it runs, a call with good items only. The good call is answered long before the
    hung item's timeout: the hung task turned suspect (0.25 s) and went on in a spare process,
    giving the experiment's share back. Before, the good call waited for that timeout (the
    experiment's one slot held until then): 3.9 s of the hung call's 4.0 s."""
    if batched:
        await _known_cheap(one_worker)

    async def timed_call(*completions: str) -> tuple[list[Score], float]:
        start = time.monotonic()
        got = await one_worker.score(SCRIPTED, {}, _items(*completions), 4.0, key="exp")
        return got, time.monotonic() - start

    hung_call = asyncio.ensure_future(timed_call("sleep 30", "ok"))
    await asyncio.sleep(0.1)  # the hung task holds the experiment's slot
    good, good_s = await timed_call("ok", "ok")
    assert good == [Score(1.0), Score(1.0)]
    hung, hung_s = await hung_call
    assert hung == [Score(0.0, FAILED, "timed out after 4s"), Score(1.0)]  # its full timeout
    assert hung_s >= 4.0
    assert good_s < hung_s / 2, (good_s, hung_s)  # not after the hung item's timeout
    assert one_worker.in_flight == 0 and one_worker.slots.free == 1
