"""Score items with a per-item timeout: cheap built-ins inline, the rest in a process pool.

Every item gets a Score: OK with a finite reward, or FAILED with a reason (timed out, the
exception's type and message, a non-numeric or non-finite return, a worker that died).

Where an item is scored:
- **Inline**, on the event loop, for the built-ins in `rewards.INLINE` (pure string work,
  linear in the text) when the item's texts are at most `rewards.INLINE_MAX_CHARS` long: a
  pool round trip costs far more than the function.
- **One pool task for all the items of a call** once the function is known cheap (its items
  took under `BATCH_MAX_ITEM_S` on average, recently; a function never seen is scored one
  task per item, so a function that hangs is killed at its own timeout from its first item).
  The worker scores the items one after another, stops an item at `timeout_s` (an alarm
  signal) and reports it timed out, and goes on; it starts no new item once `timeout_s` has
  passed, and the items left go in the next task. So a hung item holds the others back its own
  timeout, and a task runs at most about 2 x `timeout_s`, its deadline. A task that misses it
  (an item hung where the alarm cannot reach it, in C code) or whose worker dies is scored
  again **one task per item**: each item meets its own fate alone, and
  its neighbours are unaffected, and the function is scored one task per item from then on
  (until its items are cheap again).
- **One pool task per item** for a slow function (its items run in parallel across the
  workers, and pebble kills each at its own `timeout_s`).

A pool task starts only once it holds one of the processes, shared fairly between the
experiments (`services.reward.fair`): one experiment's hung items hold at most its share. A
task still running well past what its items should take (`suspect_after`: a hung item, most
likely) gives its share back and goes on in one of `spare` processes kept for such tasks, so
the experiment's other items (its other groups' calls) score in their own time, not after the
hung item's timeout; only once every spare process holds one does a hung task keep its share
until it ends. The
Score call answers before its deadline: a task that could not start by then, or was still
running then, is stopped, its items FAILED saying so. A caller's deadline is thus never the
sign of a slow reward function, only of a service that does not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import numbers
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing import forkserver, resource_tracker

import pebble
from pebble.common import ProcessExpired

from asyncrl import rewards
from asyncrl.logging import get_logger
from asyncrl.types import RewardStatus, Score, ScoreItem
from services.reward.fair import FairSlots, NotStarted

log = get_logger()

# Workers fork from a forkserver that has these imported: a fresh worker (also the one that
# replaces a worker killed at a timeout) starts in milliseconds and does not spend an item's
# timeout importing sympy. Forking from the gRPC process itself is unsafe (its threads).
PRELOAD = ["services.reward.pool", "math_verify"]

BATCH_MAX_ITEM_S = 0.01
"""A function whose items take longer than this on average is scored one pool task per item:
the ~0.2 ms a task costs is then small beside the item, and the items run in parallel."""
COST_WEIGHT = 0.1
"""Weight of the newest item in a function's moving average of seconds per item."""
TASK_SLACK_S = 0.5
"""Added to a batch task's deadline: the worker's own overhead (unpickling, the hand-off)."""
WARM_TIMEOUT_S = 120.0
"""How long `ScoringPool.warm` waits for the processes to start before the service goes on."""
SUSPECT_MIN_S = 0.25
SUSPECT_FACTOR = 4.0
"""A task is suspect (`suspect_after`) once it ran SUSPECT_MIN_S plus SUSPECT_FACTOR times
what its items took on average lately (a function never seen: SUSPECT_MIN_S)."""
ANSWER_MARGIN_S = 2.0
"""The Score call answers this long before its deadline (the answer's way back to the
caller): no task starts later, and a task still running then is stopped."""

Outcome = tuple[bool, float | str, float]
"""(True, reward, seconds) or (False, reason, seconds), as a worker reports an item."""


def default_workers() -> int:
    return min(4, os.cpu_count() or 1)


def _warm_up() -> None:
    """Pool initializer: make sure the preloaded modules are imported in each worker."""
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass


def timed_out(timeout_s: float) -> str:
    return f"timed out after {timeout_s:g}s"


def score_one(function: str, kwargs: dict[str, str], item: ScoreItem) -> tuple[bool, float | str]:
    """(True, reward) or (False, reason). Never raises, so no exception has to be pickled back
    from a worker."""
    try:
        value = rewards.resolve(function)(item.completion, item.answer, item.prompt, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported as the item's FAILED reason
        return False, f"{type(e).__name__}: {e}"
    if not isinstance(value, numbers.Real):
        return False, f"reward function returned a non-numeric value: {type(value).__name__}"
    reward = float(value)
    if not math.isfinite(reward):
        return False, f"reward function returned a non-finite value: {reward}"
    return True, reward


class _ItemTimeout(BaseException):
    """Raised in a worker by the item's alarm: a BaseException, so a plugin's own
    `except Exception` does not swallow it."""


def _raise_item_timeout(signum, frame):
    raise _ItemTimeout


@contextlib.contextmanager
def _alarm(timeout_s: float):
    """Interrupt the code inside (one item) with _ItemTimeout after `timeout_s` (SIGALRM: in a
    pool worker, whose tasks run in its main thread). Elsewhere (another thread, a platform
    without setitimer) a no-op: the item is reported timed out once it returns, and one that
    never returns is killed with its task at the task's deadline."""
    if (
        not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return
    previous = signal.signal(signal.SIGALRM, _raise_item_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def score_items(
    function: str, kwargs: dict[str, str], items: list[ScoreItem], timeout_s: float
) -> list[Outcome]:
    """Run in a worker: score `items` one after another. An item is stopped at `timeout_s`
    (its alarm) and reported timed out, as is one that took longer and returned anyway, and
    the worker goes on: a hung item holds its neighbours back its own timeout, not until its
    task is killed (2 x `timeout_s` + slack) and every item scored again. No item is started
    once `timeout_s` has passed since the first: fewer outcomes than items then, and the
    caller schedules the rest."""
    start = time.monotonic()
    out: list[Outcome] = []
    for item in items:
        t0 = time.monotonic()
        if out and t0 - start >= timeout_s:
            break
        try:
            with _alarm(timeout_s):
                ok, value = score_one(function, kwargs, item)
        except _ItemTimeout:
            ok, value = False, timed_out(timeout_s)
        seconds = time.monotonic() - t0
        if seconds > timeout_s:
            ok, value = False, timed_out(timeout_s)
        out.append((ok, value, seconds))
    return out


def _short(item: ScoreItem) -> bool:
    """Whether `item`'s texts are short enough to be scored inline (see the module docstring)."""
    return (
        len(item.completion) <= rewards.INLINE_MAX_CHARS
        and len(item.answer) <= rewards.INLINE_MAX_CHARS
    )


def _score(ok: bool, value: float | str) -> Score:
    if ok:
        return Score(reward=value)
    return Score(reward=0.0, status=RewardStatus.FAILED, reason=value)


def _failed(reason: str) -> Score:
    return Score(reward=0.0, status=RewardStatus.FAILED, reason=reason)


class PastDeadline(Exception):
    """An item not scored by the Score call's deadline (less ANSWER_MARGIN_S): its experiment's
    share of the processes stayed busy (with its own earlier items) until then, or its task
    was still running then."""


def past_deadline(e: PastDeadline) -> str:
    return f"not scored before the call's deadline: {e}"


@dataclass(frozen=True)
class _Call:
    """One Score call's reward function, per-item timeout, experiment and deadline."""

    function: str
    kwargs: dict[str, str]
    timeout_s: float
    key: str
    deadline: float | None


class ScoringPool:
    """A pebble ProcessPool plus the asyncio glue. Create it inside a running event loop."""

    def __init__(self, workers: int | None = None, spare: int | None = None):
        self.workers = workers or default_workers()
        self.spare = self.workers if spare is None else spare
        """Processes beyond `workers` for suspect tasks (see the module's doc)."""
        self._suspects = 0
        """Suspect tasks running in a spare process now."""
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self._pool = pebble.ProcessPool(
            max_workers=self.workers + self.spare, initializer=_warm_up, context=ctx
        )
        self.slots = FairSlots(self.workers)
        """Who may start a pool task now: at most `workers` tasks are in the pool at once, so
        pebble's own queue stays empty and each task's timeout runs from when it was sent."""
        self.in_flight = 0
        """Items in the pool now (scheduled, not yet answered)."""
        self._cost: dict[str, float] = {}
        """Moving average of seconds per item, per function scored in the pool."""

    async def warm(self) -> None:
        """Start the processes now rather than at the first pooled item: the forkserver with
        PRELOAD imported and every worker forked from it. A reward service registers only after
        this, so the successor of a hand-over scores its first pooled items at once; a cold pool
        took 2-8 s for its first item on the loaded 2-core machine, a stall of every run whose
        reward function is not inline. A pool that does not start in WARM_TIMEOUT_S is left to
        start on demand (logged)."""
        started = time.monotonic()
        tasks = [asyncio.wrap_future(self._pool.schedule(_warm_up)) for _ in range(self.workers)]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), WARM_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - scoring still starts the pool on demand
            log.warning("reward_pool_cold", error=repr(e), waited_s=_since(started))
            return
        log.info("reward_pool_warm", workers=self.workers, seconds=_since(started))

    async def score(
        self,
        function: str,
        kwargs: dict[str, str],
        items: list[ScoreItem],
        timeout_s: float,
        key: str = "",
        deadline: float | None = None,
    ) -> list[Score]:
        """Score `items` with the reward function called `function`; results in item order.
        `key` (the experiment) is whose share of the processes the items use; `deadline`
        (time.monotonic) is when the answer is due: no task is started that could not end by
        then."""
        call = _Call(function, kwargs, timeout_s, key, deadline)
        results: list[Score | None] = [None] * len(items)
        pooled = []
        inline = function in rewards.INLINE
        for i, item in enumerate(items):
            if inline and _short(item):
                results[i] = _score(*score_one(function, kwargs, item))
            else:
                pooled.append(i)
        if pooled:
            scores = await self._pooled(call, [items[i] for i in pooled])
            for i, s in zip(pooled, scores, strict=True):
                results[i] = s
        return results

    async def _pooled(self, call: _Call, items: list[ScoreItem]) -> list[Score]:
        cost = self._cost.get(call.function)  # None: never seen, so it may hang: not batched
        if len(items) == 1 or cost is None or cost > BATCH_MAX_ITEM_S:
            return await self._one_by_one(call, items)
        scores: list[Score] = []
        while len(scores) < len(items):
            rest = items[len(scores) :]
            try:
                outcomes = await self._run(call, rest, 2 * call.timeout_s + TASK_SLACK_S)
            except PastDeadline as e:
                return scores + [_failed(past_deadline(e)) for _ in rest]
            except Exception:  # noqa: BLE001 - an item hung or killed its worker: each alone
                # and from now on: a hung item then holds a pool slot for its timeout, once
                self._cost[call.function] = max(self._cost.get(call.function, 0.0), call.timeout_s)
                return scores + await self._one_by_one(call, rest)
            scores += [_score(ok, value) for ok, value, _ in outcomes]
        return scores

    async def _one_by_one(self, call: _Call, items: list[ScoreItem]) -> list[Score]:
        return list(await asyncio.gather(*(self._score_item(call, item) for item in items)))

    async def _score_item(self, call: _Call, item: ScoreItem) -> Score:
        try:
            [(ok, value, _)] = await self._run(call, [item], call.timeout_s)
        except PastDeadline as e:
            return _failed(past_deadline(e))
        except TimeoutError:
            self._observe(call.function, call.timeout_s)
            return _failed(timed_out(call.timeout_s))
        except ProcessExpired as e:
            return _failed(f"worker died (exit code {e.exitcode})")
        except Exception as e:  # noqa: BLE001 - e.g. unpicklable arguments; still a result
            return _failed(f"{type(e).__name__}: {e}")
        return _score(ok, value)

    async def _run(self, call: _Call, items: list[ScoreItem], deadline_s: float) -> list[Outcome]:
        """One pool task scoring `items` (`score_items`), once a slot of `call.key`'s share is
        free, killed after `deadline_s` or at the call's deadline, whichever comes first
        (PastDeadline then, as when no slot came free before it)."""
        answer_by = None if call.deadline is None else call.deadline - ANSWER_MARGIN_S
        try:
            await self.slots.acquire(call.key, answer_by)
        except NotStarted as e:
            raise PastDeadline(str(e)) from None
        self.in_flight += len(items)
        limit = deadline_s if answer_by is None else min(deadline_s, answer_by - time.monotonic())
        spare = False
        try:
            future = self._pool.schedule(
                score_items,
                args=(call.function, call.kwargs, items, call.timeout_s),
                timeout=max(limit, 0.01),
            )
            task = asyncio.wrap_future(future)
            done, _ = await asyncio.wait({task}, timeout=self.suspect_after(call, len(items)))
            if not done and self._suspects < self.spare:  # hung, likely: off the share
                spare, self._suspects = True, self._suspects + 1
                self.slots.release(call.key)
            outcomes = await task
        except TimeoutError:
            if limit < deadline_s:
                raise PastDeadline(f"stopped after {limit:.1f}s, at its deadline") from None
            raise
        finally:
            self.in_flight -= len(items)
            if spare:
                self._suspects -= 1
            else:
                self.slots.release(call.key)
        for _, _, seconds in outcomes:
            self._observe(call.function, seconds)
        return outcomes

    def suspect_after(self, call: _Call, n_items: int) -> float:
        """Seconds after which a task of `n_items` items of `call`'s function is suspect."""
        return SUSPECT_MIN_S + SUSPECT_FACTOR * self._cost.get(call.function, 0.0) * n_items

    def _observe(self, function: str, seconds: float) -> None:
        cost = self._cost.get(function, seconds)
        self._cost[function] = cost + COST_WEIGHT * (seconds - cost)

    async def close(self) -> None:
        """Stop the workers (running items are abandoned) and wait for them to exit."""
        self._pool.stop()
        await asyncio.to_thread(self._pool.join)


async def stop_helpers() -> None:
    """Stop and reap this process's multiprocessing forkserver and resource tracker, once the
    pool is closed (the service's close): left to exit with it, they were orphans, zombies
    under an init that does not reap (one pair per reward process since the pool starts
    warm)."""

    def stop() -> None:
        for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
            try:
                helper._stop()
            except (OSError, AttributeError) as e:  # gone already, or another Python's API
                log.warning(
                    "reward_helper_stop_failed", helper=type(helper).__name__, error=repr(e)
                )

    await asyncio.to_thread(stop)


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
