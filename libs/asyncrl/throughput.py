"""A token-rate window shared by the rollout (its own generation) and the scheduler (its
fleet's): a running total and the rate over the last `window_s` seconds."""

from __future__ import annotations

import collections
import time


class Throughput:
    """Generated tokens: a running total and the rate over the last `window_s` seconds. The
    window's sum is kept as events enter and leave it: `rate` costs nothing per event (the
    scheduler adds thousands a second and reads the rate with every progress report)."""

    def __init__(self, window_s: float = 30.0):
        self.window_s = window_s
        self.total = 0
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._recent = 0
        self._since = time.monotonic()

    def add(self, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.total += tokens
        self._events.append((now, tokens))
        self._recent += tokens
        self._expire(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._expire(now)
        span = min(self.window_s, max(now - self._since, 1e-9))
        return self._recent / span

    def _expire(self, now: float) -> None:
        """Drop the events older than the window from it."""
        events = self._events
        while events and events[0][0] < now - self.window_s:
            self._recent -= events.popleft()[1]
