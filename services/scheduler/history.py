"""Each experiment's steps and evals, appended to a JetStream stream (subject
`asyncrl.sched.history.<experiment>`), so the KV record stays bounded however long the run.

Appends are queued and written in order by one writer task that retries while NATS is away; a
restarted scheduler reads an experiment's entries back (`load`). A step whose version is not
above the previous one starts a new lineage (the trainer resumed from an older checkpoint): the
steps it replaces are dropped on load, as they are in memory (`ExperimentRecord.add_step`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import nats.errors
import nats.js.errors

from asyncrl.logging import get_logger, raise_if_cancelled
from asyncrl.natsutil import ensure_file_stream, read_subject
from asyncrl.types import EvalResult, StepMetrics
from services.scheduler.records import ExperimentRecord, build_dataclass, flat_dict

log = get_logger(component="history")
STREAM = "ASYNCRL_SCHED_HISTORY"
SUBJECT_ROOT = "asyncrl.sched.history"
RETRY_S = 0.5
FETCH_BATCH = 1000


def history_subject(experiment_id: str) -> str:
    return f"{SUBJECT_ROOT}.{experiment_id}"


class HistoryLog:
    def __init__(self, js, held: Callable[[], bool] = lambda: True):
        self.js = js
        self.held = held
        """Whether the scheduler holds its lease: an append waits until it does."""
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    @classmethod
    async def open(cls, js, held: Callable[[], bool] = lambda: True) -> HistoryLog:
        """The history stream, created on first use."""
        await ensure_file_stream(js, STREAM, [f"{SUBJECT_ROOT}.>"])
        return cls(js, held)

    def start(self) -> None:
        self._task = asyncio.create_task(self._write_forever(), name="history-writer")

    def append_step(self, experiment_id: str, step: StepMetrics) -> None:
        self._append(experiment_id, {"step": flat_dict(step)})

    def append_eval(self, experiment_id: str, result: EvalResult) -> None:
        self._append(experiment_id, {"eval": flat_dict(result)})

    def _append(self, experiment_id: str, entry: dict) -> None:
        self._queue.put_nowait((history_subject(experiment_id), json.dumps(entry).encode()))

    async def _write_forever(self) -> None:
        while True:
            raise_if_cancelled("history-writer")
            subject, data = await self._queue.get()
            while True:
                while not self.held():
                    await asyncio.sleep(RETRY_S)
                try:
                    await self.js.publish(subject, data)
                    break
                except (TimeoutError, nats.errors.Error) as e:
                    log.warning("history_append_failed", subject=subject, error=str(e))
                    await asyncio.sleep(RETRY_S)

    async def close(self, timeout: float = 5.0) -> None:
        """Stop the writer; what is still queued is written now (until the first failure)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while not self._queue.empty() and self.held():
            subject, data = self._queue.get_nowait()
            try:
                await self.js.publish(subject, data, timeout=timeout)
            except (TimeoutError, nats.errors.Error) as e:
                lost = self._queue.qsize() + 1
                log.warning("history_lost_on_close", entries=lost, error=str(e))
                return

    async def load_into(self, record: ExperimentRecord) -> None:
        """Replace the record's history and evals with the logged ones (if any)."""
        entries = await self._read(history_subject(record.id))
        if not entries:
            return
        replay = ExperimentRecord(record.id, record.name, {})
        for entry in entries:
            if "step" in entry:
                replay.add_step(build_dataclass(StepMetrics, entry["step"]))
            elif "eval" in entry:
                replay.evals.append(build_dataclass(EvalResult, entry["eval"]))
        record.history = replay.history
        known = {e.version for e in replay.evals}
        record.evals = replay.evals + [e for e in record.evals if e.version not in known]

    async def _read(self, subject: str) -> list[dict]:
        """Every entry on `subject`, in order."""
        return [json.loads(d) for d in await read_subject(self.js, STREAM, subject, FETCH_BATCH)]
