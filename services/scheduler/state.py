"""Experiment records in NATS KV: one key `exp.<id>` per experiment, JSON, written coalesced.

Callers mark an experiment dirty after every state-changing event; a flusher writes the latest
snapshot of each dirty experiment at most every `min_interval_s` (about 5 writes/s), or less
often when the records are so large that this would take over `FLUSH_CPU_PERCENT` of the CPU.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType

from asyncrl.logging import get_logger, keep_running
from asyncrl.natsutil import KV_BUCKET
from asyncrl.settings import settings
from services.scheduler.leadership import Leadership, NotHeld
from services.scheduler.records import ExperimentRecord

log = get_logger(component="state")
KEY_PREFIX = "exp."
FLUSH_CPU_PERCENT = 10
"""The most of the scheduler's CPU the flusher takes: after a flush it waits at least nine times
the CPU time that flush took (a large run's record is ~1 MB of JSON, ~65 ms to encode). CPU, not
wall time: a flush that waited for NATS does not push the next one back."""


def flush_pause(took_cpu_s: float, min_interval_s: float) -> float:
    """Seconds the flusher waits after a flush that took `took_cpu_s` of CPU."""
    return max(min_interval_s, (100 / FLUSH_CPU_PERCENT - 1) * took_cpu_s)


def record_key(experiment_id: str) -> str:
    return f"{KEY_PREFIX}{experiment_id}"


async def open_bucket(js):
    """The scheduler's KV bucket (records and the lease), created on first use."""
    try:
        return await js.key_value(KV_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_key_value(
            KeyValueConfig(
                bucket=KV_BUCKET,
                history=1,
                storage=StorageType.FILE,
                replicas=settings().nats_replicas,
            )
        )


class StateStore:
    """With a `fence` (the scheduler's `Leadership`) every write is a compare-and-set on the
    revision this store last saw of the key (read at `load_all`, which writes every record back
    once so that a former leader's revisions are all stale), and only while the lease is held:
    a write a paused former leader makes late fails, and it steps down."""

    def __init__(self, kv, js, min_interval_s: float = 0.2, fence: Leadership | None = None):
        self.kv = kv
        self.js = js
        self.min_interval_s = min_interval_s
        self.fence = fence
        self._revisions: dict[str, int] = {}
        """The revision of each record as this store last wrote or read it."""
        self._dirty: dict[str, Callable[[], ExperimentRecord]] = {}
        self._unstored: set[str] = set()
        """Experiments whose last flush could not write their record (`stored`)."""
        self._event = asyncio.Event()
        self._flushing = asyncio.Lock()
        self._task: asyncio.Task | None = None

    @classmethod
    async def open(
        cls, js, min_interval_s: float = 0.2, fence: Leadership | None = None
    ) -> StateStore:
        return cls(await open_bucket(js), js, min_interval_s, fence)

    def held(self) -> bool:
        """Whether this scheduler may write now (it holds its lease, or has no fence)."""
        return self.fence is None or self.fence.held()

    async def load_all(self) -> list[ExperimentRecord]:
        records = []
        for key in await self._keys():
            try:
                entry = await self._claim(key)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):  # by hand
                continue
            try:
                records.append(ExperimentRecord.from_json(entry.value))
            except (ValueError, KeyError, TypeError) as e:
                log.error("state_record_unreadable", key=key, error=str(e))
        return sorted(records, key=lambda r: r.created_unix_ms)

    async def _claim(self, key: str):
        """The record at `key`; with a fence, written back as it is (its revision is this
        store's own from now on: any write based on an earlier one fails)."""
        while True:
            entry = await self.kv.get(key)
            if self.fence is None:
                return entry
            try:
                self._revisions[key] = await self.kv.update(key, entry.value, last=entry.revision)
                return entry
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # the former leader's last write landed just now: take that one

    async def _keys(self) -> list[str]:
        """The experiment keys, from the bucket stream's subjects. (nats-py's `kv.keys()` reads
        them through a watcher that, on a loaded machine, can report the end before the first
        key: a restarted scheduler then resumed no experiment; the CI suite caught it.)"""
        prefix = f"$KV.{KV_BUCKET}."
        info = await self.js.stream_info(
            f"KV_{KV_BUCKET}", subjects_filter=f"{prefix}{KEY_PREFIX}>"
        )
        return sorted(s.removeprefix(prefix) for s in (info.state.subjects or {}))

    def mark_dirty(self, experiment_id: str, snapshot: Callable[[], ExperimentRecord]) -> None:
        """Schedule a write of `snapshot()` (taken at write time, so the latest state wins)."""
        self._dirty[experiment_id] = snapshot
        self._event.set()

    async def save(self, record: ExperimentRecord) -> None:
        """Write `record` (NotHeld without the lease; a compare-and-set that fails steps this
        scheduler down unless the lease is still its own, when it raises NotHeld and the
        next write takes the revision read now)."""
        key, data = record_key(record.id), record.to_json()
        if self.fence is None:
            await self.kv.put(key, data)
            return
        if not self.held():
            raise NotHeld("the scheduler's lease is not renewed")
        last = self._revisions.get(key)
        try:
            if last is None:
                self._revisions[key] = await self.kv.create(key, data)
            else:
                self._revisions[key] = await self.kv.update(key, data, last=last)
        except nats.js.errors.KeyWrongLastSequenceError:
            if await self.fence.confirm():  # a write of ours whose answer a timeout lost
                self._revisions[key] = (await self.kv.get(key)).revision
            raise NotHeld(f"{key} changed under this scheduler") from None

    def start(self) -> None:
        self._task = asyncio.create_task(self._flush_forever(), name="state-flusher")

    def stored(self, experiment_id: str) -> bool:
        """The last flush stored the experiment's record (or had nothing of it to write)."""
        return experiment_id not in self._unstored

    async def flush(self) -> None:
        """Write every experiment marked dirty; a flush already under way finishes first, so
        on return everything marked before the call is in KV (or failed and is dirty again).
        With the connection to NATS down it writes nothing and returns at once (a write would
        only wait out its timeout): all stays dirty for the next flush."""
        async with self._flushing:
            if not self.js._nc.is_connected:  # the client's state: reconnecting, closed
                self._unstored |= self._dirty.keys()
                return
            dirty, self._dirty = self._dirty, {}
            for experiment_id, snapshot in dirty.items():
                try:
                    await self.save(snapshot())
                    self._unstored.discard(experiment_id)
                except (TimeoutError, nats.errors.Error, NotHeld) as e:
                    log.warning("state_save_failed", experiment=experiment_id, error=str(e))
                    self._dirty.setdefault(experiment_id, snapshot)
                    self._unstored.add(experiment_id)

    async def close(self) -> None:
        """Stop the flusher and write what is still dirty."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.flush()

    async def _flush_forever(self) -> None:
        async def flush_once() -> None:
            await self._event.wait()
            self._event.clear()
            t0 = time.process_time()
            await self.flush()
            if self._dirty:
                self._event.set()
            await asyncio.sleep(flush_pause(time.process_time() - t0, self.min_interval_s))

        await keep_running("state_flusher", flush_once, log, retry_s=self.min_interval_s)
