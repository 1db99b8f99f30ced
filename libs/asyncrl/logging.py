"""structlog configured once per process: JSON lines in services, console for humans.

Logging never raises into the code that logs: the services' stderr is a file under var/log,
and on a full disk (ENOSPC) a write that raised would end whatever loop logged it (a
heartbeat, the lease sweeper, an error path). `configure_logging` puts a `SafeSink` in front
of stderr: a failed write is dropped and counted (`SafeSink.dropped`), and the first line
written after a failure says how many were lost and why (`log_lines_dropped`).

`keep_running` is the shape of every long-lived control loop: one pass of the loop's body,
again and again; an exception a pass raises is logged (with its traceback) and the body runs
again after a pause, so no loop dies in silence.
"""

from __future__ import annotations

import asyncio
import io
import json as jsonlib
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable

import structlog

from asyncrl.settings import settings


class SafeSink:
    """A text stream in front of `stream` (stderr) whose write errors are counted, never
    raised. A line is written with one `os.write` on the stream's file descriptor (no Python
    buffer that would keep failed bytes and raise again on the next write); a stream without a
    descriptor (a test's capture) is written and flushed as it is."""

    def __init__(self, stream):
        self.stream = stream
        self.dropped = 0
        """Writes lost to an error since the sink was made."""
        self.last_error = ""
        self._unreported = 0
        self._lock = threading.Lock()
        try:
            stream.flush()
            self._fd: int | None = stream.fileno()
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            self._fd = None

    def write(self, text: str) -> int:
        with self._lock:
            if self._unreported and self._put(self._dropped_line()):
                self._unreported = 0
            if not self._put(text):
                self.dropped += 1
                self._unreported += 1
        return len(text)

    def _put(self, text: str) -> bool:
        try:
            if self._fd is None:
                self.stream.write(text)
                self.stream.flush()
                return True
            data = text.encode("utf-8", "backslashreplace")
            while data:
                data = data[os.write(self._fd, data) :]
        except (OSError, ValueError) as exc:  # ENOSPC, EIO, EPIPE, a closed stream
            self.last_error = f"{type(exc).__name__}: {exc}"
            return False
        return True

    def _dropped_line(self) -> str:
        event = {"event": "log_lines_dropped", "level": "warning", "lines": self._unreported}
        event["error"] = self.last_error
        return jsonlib.dumps(event) + "\n"

    def flush(self) -> None:
        if self._fd is None:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (OSError, ValueError):
            return False

    def __getattr__(self, name: str):  # encoding, errors, buffer, ...: the stream's own
        return getattr(self.stream, name)


def safe_stderr() -> SafeSink:
    """sys.stderr behind a SafeSink (made once: a second call returns the same sink)."""
    if not isinstance(sys.stderr, SafeSink):
        sys.stderr = SafeSink(sys.stderr)
    return sys.stderr


def configure_logging(
    service: str, json: bool | None = None, level: str | None = None, stream=None
) -> SafeSink:
    """Configure structlog for `service`. JSON unless ASYNCRL_LOG_FORMAT=console. Lines go to
    `stream` behind a SafeSink (default: stderr, which is replaced by its sink, so a traceback
    or a print() on a full disk does not raise either); returns the sink."""
    config = settings()
    if json is None:
        json = config.log_format == "json"
    lvl = getattr(logging, (level or config.log_level).upper())
    sink = safe_stderr() if stream is None else SafeSink(stream)
    logging.basicConfig(level=lvl, stream=sink, format="%(message)s")
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
        logger_factory=structlog.WriteLoggerFactory(file=sink),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)
    return sink


class CurrentStderr:
    """Whatever `sys.stderr` is at each write (a CLI run under a test runner swaps it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_cli_logging() -> None:
    """The CLI's log lines (a retry, a malformed ledger event) go to stderr in console form:
    stdout carries only the command's output (`asyncrl ledger --json | jq`)."""
    configure_logging("cli", json=False, stream=CurrentStderr())


def raise_if_cancelled(name: str) -> None:
    """CancelledError if the running task was cancelled and the cancel did not reach it: a
    loop calls this before each pass (Python 3.11's `asyncio.wait_for`, which nats-py's calls
    use, can swallow a cancel that comes as its future completes; the loop would wait on)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError(f"{name}: cancelled during its last pass")


async def keep_running(
    name: str,
    body: Callable[[], Awaitable[None]],
    log,
    retry_s: float = 1.0,
    until: Callable[[], bool] | None = None,
) -> None:
    """Run `body` (one pass of a control loop) until cancelled, or until `until()` is true
    before a pass. A pass that raises is logged as `loop_error` (`name`, the error, its
    traceback) and the next starts after `retry_s`: a bug, a full disk or a broker away never
    ends the loop in silence. A cancel a pass swallowed (Python 3.11's `asyncio.wait_for` can,
    when its future completes as the cancel comes) still ends the loop before the next pass."""
    while until is None or not until():
        raise_if_cancelled(name)
        try:
            await body()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - logged, then the loop goes on
            log.exception("loop_error", loop=name, error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(retry_s)


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
