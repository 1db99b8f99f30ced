"""A token-rate window shared by the rollout (its own generation) and the scheduler (its
fleet's): a running total and the rate over the last `window_s` seconds."""

from __future__ import annotations

import collections
import time


class Throughput:
    """Generated tokens: a running total and the rate over the last `window_s` seconds."""

    def __init__(self, window_s: float = 30.0):
        self.window_s = window_s
        self.total = 0
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._since = time.monotonic()

    def add(self, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.total += tokens
        self._events.append((now, tokens))
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        recent = sum(n for t, n in self._events if t >= now - self.window_s)
        span = min(self.window_s, max(now - self._since, 1e-9))
        return recent / span
