"""structlog configured once per process: JSON lines in services, console for humans."""

from __future__ import annotations

import logging
import sys
import time

import structlog

from asyncrl.settings import settings


def configure_logging(service: str, json: bool | None = None, level: str | None = None) -> None:
    """Configure structlog for `service`. JSON unless ASYNCRL_LOG_FORMAT=console."""
    config = settings()
    if json is None:
        json = config.log_format == "json"
    lvl = getattr(logging, (level or config.log_level).upper())
    logging.basicConfig(level=lvl, stream=sys.stderr, format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(**ctx):
    """A lazy logger: safe at module level, it picks up configure_logging() called later."""
    return structlog.get_logger(**ctx)


class Tally:
    """One INFO line `event` for many calls, where a line each costs too much on a hot path:
    `add` sums counts by name, and the first `add` at least `every_s` seconds after the last
    line logs the sums since it (with `seconds`, the interval) and starts again from zero. A
    name not added in an interval is not on its line.

    `now` is read on `time.perf_counter`, as is `start` (the first interval's beginning:
    when the tally is made, unless given)."""

    def __init__(self, event: str, log, every_s: float = 10.0, start: float | None = None):
        self.event = event
        self.log = log
        self.every_s = every_s
        self._since = time.perf_counter() if start is None else start
        self._counts: dict[str, int] = {}

    def add(self, now: float, **counts: int) -> None:
        sums = self._counts
        for name, n in counts.items():
            sums[name] = sums.get(name, 0) + n
        if now - self._since >= self.every_s:
            self.log.info(self.event, **sums, seconds=round(now - self._since, 1))
            self._since, self._counts = now, {}
