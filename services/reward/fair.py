"""The reward service's scoring processes, shared fairly between the experiments it serves.

One pool task holds one scoring process. Without a share, a task waits in the pool's single
FIFO queue: an experiment whose plugin hangs fills the queue with items that each hold a
process for their whole `timeout_s`, and every other experiment's items wait behind them.

`FairSlots` hands the processes out instead:
- **a cap per experiment**: while k experiments are *active* (holding or waiting for a slot,
  or bound or scoring within the last `ACTIVE_S`), each holds at most ceil(slots / k) slots
  at once, so with two experiments on two processes a hung one holds one and the other always
  finds its own free;
- **round-robin** between the experiments with items waiting: a freed slot goes to the next
  experiment in turn that is under its cap, each experiment's own items first come first
  served.

A wait has a bound, `start_by` (the Score call's deadline less the task's own run time): a task
that has not started by then is not started at all (`NotStarted`), so the service answers
before the caller's deadline with what it could score.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time

ACTIVE_S = 60.0
"""An experiment bound or scoring within this long keeps its share of the slots reserved."""


class NotStarted(Exception):
    """No slot came free for the task before its start-by time; the message says how long it
    waited."""


class FairSlots:
    """`slots` slots shared round-robin between keys (experiment ids), each capped at its fair
    share. Use from one event loop."""

    def __init__(self, slots: int, clock=time.monotonic):
        self.slots = slots
        self._clock = clock
        self.held: collections.Counter[str] = collections.Counter()
        self._waiting: dict[str, collections.deque[asyncio.Future]] = {}
        self._turn: collections.deque[str] = collections.deque()
        """Keys in round-robin order: the next to be served first."""
        self._seen: dict[str, float] = {}
        """When each key was last bound, scored or released a slot."""

    def touch(self, key: str) -> None:
        """`key` is active now (bound, or a Score call came for it)."""
        self._seen[key] = self._clock()

    def active(self) -> int:
        """Experiments holding or waiting for a slot, or seen within ACTIVE_S."""
        now = self._clock()
        for key in [k for k, t in self._seen.items() if now - t > ACTIVE_S]:
            if not self.held[key] and not self._waiting.get(key):
                del self._seen[key]
        return len(
            self._seen.keys() | {k for k, n in self.held.items() if n} | self._waiting.keys()
        )

    def cap(self) -> int:
        """Slots one experiment may hold at once now."""
        return max(1, math.ceil(self.slots / max(1, self.active())))

    @property
    def free(self) -> int:
        return self.slots - sum(self.held.values())

    async def acquire(self, key: str, start_by: float | None = None) -> None:
        """Wait for a slot for `key` (release it with `release`). Raises NotStarted when none
        came by `start_by` (this clock's time; None: no bound)."""
        self.touch(key)
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, collections.deque()).append(waiter)
        if key not in self._turn:
            self._turn.append(key)
        self._dispatch()
        t0 = self._clock()
        timeout = None if start_by is None else max(0.0, start_by - t0)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except (TimeoutError, asyncio.CancelledError) as e:
            if waiter.done() and not waiter.cancelled():
                self.release(key)  # granted as the wait ended: give it on
            else:
                waiter.cancel()
                self._forget(key, waiter)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise NotStarted(f"waited {self._clock() - t0:.1f}s for a scoring process") from None

    def release(self, key: str) -> None:
        self.held[key] -= 1
        if not self.held[key]:
            del self.held[key]
        self.touch(key)
        self._dispatch()

    def _forget(self, key: str, waiter: asyncio.Future) -> None:
        queue = self._waiting.get(key)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
        if queue is not None and not queue:
            del self._waiting[key]
        self._dispatch()  # the cap may have grown

    def _dispatch(self) -> None:
        """Give free slots to waiting keys, round-robin, each up to the cap."""
        cap = self.cap()
        while self.free > 0:
            key = self._next(cap)
            if key is None:
                return
            waiter = self._waiting[key].popleft()
            if not self._waiting[key]:
                del self._waiting[key]
            self.held[key] += 1
            waiter.set_result(None)

    def _next(self, cap: int) -> str | None:
        """The next key in turn with a waiter and under `cap`; it goes to the back of the turn."""
        for _ in range(len(self._turn)):
            key = self._turn.popleft()
            if not self._waiting.get(key):
                continue  # nothing waiting: out of the turn until it waits again
            self._turn.append(key)
            if self.held[key] < cap:
                return key
        return None
