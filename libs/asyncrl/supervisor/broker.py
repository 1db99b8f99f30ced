"""Is nats-server still storing? The supervisor's probe of the broker it runs.

nats-server that failed a write on a full disk keeps the error: every later write to that
stream is refused (the publish times out; its log says `no space left on device`) after space
has returned, until the server restarts (seen with nats-server 2.x: ledger, KV and trajectory
writes refused for minutes with 94 MB free). Two ways to see it, either restarts the broker:

- `BrokerWatch`: a thread publishes PROBE_BYTES to its own file stream `ASYNCRL_PROBE` every
  `every_s` (so the probe stream fails with the others while the disk is full), and `stuck()`
  says why once `limit` probes in a row failed while connected and while the store had room
  (`min_free_bytes`). A probe made with the disk full does not count: that broker is right to
  refuse.
- `NatsLogWatch`: nats-server's log says `no space left on device` while the store has room.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from asyncrl.logging import get_logger
from asyncrl.natsutil import connect
from asyncrl.storage import free_bytes

log = get_logger(component="broker_watch")

PROBE_STREAM = "ASYNCRL_PROBE"
PROBE_SUBJECT = "asyncrl.probe"
PROBE_BYTES = 8192
"""A probe's payload: two pages or more, so each probe allocates on the disk (a small one fits
in a page the stream's block already has, and succeeds on a full tmpfs)."""
PROBE_STREAM_BYTES = 64 * 1024
"""The probe stream keeps this much at most (small blocks, rotated often)."""
MIN_FREE_BYTES = 16 * 2**20
NO_SPACE = b"no space left on device"


class BrokerWatch:
    def __init__(
        self,
        url: str,
        store_dir: Path,
        every_s: float = 1.0,
        timeout_s: float = 2.0,
        limit: int = 3,
        min_free_bytes: int = MIN_FREE_BYTES,
    ):
        self.url = url
        self.store_dir = Path(store_dir)
        self.every_s = every_s
        self.timeout_s = timeout_s
        self.limit = limit
        self.min_free_bytes = min_free_bytes
        self._lock = threading.Lock()
        self._failures = 0
        """Probes failed in a row while connected and with room on the store's disk."""
        self._error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="broker-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def stuck(self) -> str:
        """Why the broker must be restarted ("" while it stores, or the disk is full)."""
        with self._lock:
            if self._failures < self.limit:
                return ""
            free = free_bytes(self.store_dir) or 0
            return (
                f"{self._failures} probe writes refused in a row with "
                f"{free / 2**20:.0f} MiB free on {self.store_dir}: {self._error}"
            )

    def reset(self) -> None:
        """The broker was restarted: count afresh."""
        with self._lock:
            self._failures, self._error = 0, ""

    def _main(self) -> None:
        try:
            asyncio.run(self._probe_forever())
        except Exception as exc:  # noqa: BLE001 - the watch is advice: the supervisor goes on
            log.exception("broker_watch_ended", error=repr(exc))

    async def _probe_forever(self) -> None:
        nc = await connect(self.url, identity="scheduler", connect_timeout=2)
        js = nc.jetstream(timeout=self.timeout_s)
        ready = False
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if not ready:
                    await _ensure_probe_stream(js)
                    ready = True
                await js.publish(PROBE_SUBJECT, bytes(PROBE_BYTES), timeout=self.timeout_s)
                self.reset()
            except Exception as exc:  # noqa: BLE001 - counted; the next probe tries again
                self._failed(nc.is_connected, f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(max(0.0, self.every_s - (time.monotonic() - started)))
        await nc.close()

    def _failed(self, connected: bool, error: str) -> None:
        room = (free_bytes(self.store_dir) or 0) >= self.min_free_bytes
        with self._lock:
            if connected and room:
                self._failures += 1
                self._error = error
            else:  # away (restarting) or rightly refusing on a full disk
                self._failures = 0


async def _ensure_probe_stream(js) -> None:
    cfg = StreamConfig(
        name=PROBE_STREAM,
        subjects=[PROBE_SUBJECT],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        max_msgs=1,
        max_bytes=PROBE_STREAM_BYTES,
    )
    await js.add_stream(cfg)  # the same config again is no error


class NatsLogWatch:
    """nats-server's own word: its log says a write failed for lack of space (`NO_SPACE`)
    while its store has room (`min_free_bytes`): it kept the error. `stuck()` reads the lines
    added since the last call; `limit` such lines since the last reset are a reason to restart
    it. Lines written while the disk was full do not count (they are mostly lost anyway)."""

    def __init__(
        self, log_path: Path, store_dir: Path, limit: int = 2, min_free_bytes: int = MIN_FREE_BYTES
    ):
        self.log_path = Path(log_path)
        self.store_dir = Path(store_dir)
        self.limit = limit
        self.min_free_bytes = min_free_bytes
        self._offset = self._size()  # what was there before does not count
        self._seen = 0
        self._last = ""

    def _size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def stuck(self) -> str:
        size = self._size()
        if size < self._offset:  # truncated or replaced
            self._offset = 0
        if size == self._offset:
            return self._why()
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                new = f.read(size - self._offset)
        except OSError:
            return self._why()
        self._offset = size
        lines = [line for line in new.splitlines() if NO_SPACE in line]
        if lines:
            if (free_bytes(self.store_dir) or 0) >= self.min_free_bytes:
                self._seen += len(lines)
                self._last = lines[-1].decode(errors="replace")[-300:]
            else:
                self._seen = 0
        return self._why()

    def _why(self) -> str:
        if self._seen < self.limit:
            return ""
        return f"{self._seen} write errors logged with room on {self.store_dir}: {self._last}"

    def reset(self) -> None:
        self._offset, self._seen, self._last = self._size(), 0, ""
