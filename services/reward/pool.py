"""Score items in a process pool with a per-item timeout (pebble kills a runaway worker).

Every item gets a Score: OK with a finite reward, or FAILED with a reason (timed out, the
exception's type and message, a non-numeric or non-finite return, a worker that died).
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import numbers
import os
from dataclasses import dataclass

import pebble
from pebble.common import ProcessExpired

from asyncrl import rewards
from asyncrl.types import RewardStatus, Score

# Workers fork from a forkserver that has these imported: a fresh worker (also the one that
# replaces a worker killed at a timeout) starts in milliseconds and does not spend an item's
# timeout importing sympy. Forking from the gRPC process itself is unsafe (its threads).
PRELOAD = ["services.reward.pool", "math_verify"]


@dataclass(frozen=True)
class Item:
    id: str
    completion: str
    answer: str
    prompt: str = ""


def default_workers() -> int:
    return min(4, os.cpu_count() or 1)


def _warm_up() -> None:
    """Pool initializer: make sure the preloaded modules are imported in each worker."""
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass


def score_one(function: str, kwargs: dict[str, str], item: Item) -> tuple[bool, float | str]:
    """Run in a worker: (True, reward) or (False, reason). Never raises, so no exception has to
    be pickled back."""
    try:
        value = rewards.resolve(function)(item.completion, item.answer, item.prompt, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported as the item's FAILED reason
        return False, f"{type(e).__name__}: {e}"
    if isinstance(value, numbers.Real):
        reward = float(value)
        if math.isfinite(reward):
            return True, reward
        return False, f"reward function returned a non-finite value: {reward}"
    return False, f"reward function returned a non-numeric value: {type(value).__name__}"


class ScoringPool:
    """A pebble ProcessPool plus the asyncio glue. Create it inside a running event loop."""

    def __init__(self, workers: int | None = None):
        self.workers = workers or default_workers()
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self._pool = pebble.ProcessPool(max_workers=self.workers, initializer=_warm_up, context=ctx)
        self.in_flight = 0

    async def score(
        self, function: str, kwargs: dict[str, str], items: list[Item], timeout_s: float
    ) -> list[Score]:
        """Score `items` with the reward function called `function`; results in item order."""
        return list(
            await asyncio.gather(
                *(self._score_item(function, kwargs, item, timeout_s) for item in items)
            )
        )

    async def _score_item(
        self, function: str, kwargs: dict[str, str], item: Item, timeout_s: float
    ) -> Score:
        future = self._pool.schedule(score_one, args=(function, kwargs, item), timeout=timeout_s)
        self.in_flight += 1
        try:
            ok, value = await asyncio.wrap_future(future)
        except TimeoutError:
            return Score(0.0, RewardStatus.FAILED, f"timed out after {timeout_s:g}s")
        except ProcessExpired as e:
            return Score(0.0, RewardStatus.FAILED, f"worker died (exit code {e.exitcode})")
        except Exception as e:  # noqa: BLE001 - e.g. unpicklable arguments; still a result
            return Score(0.0, RewardStatus.FAILED, f"{type(e).__name__}: {e}")
        finally:
            self.in_flight -= 1
        if ok:
            return Score(value)
        return Score(0.0, RewardStatus.FAILED, value)

    async def close(self) -> None:
        """Stop the workers (running items are abandoned) and wait for them to exit."""
        self._pool.stop()
        await asyncio.to_thread(self._pool.join)
