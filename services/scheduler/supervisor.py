"""The trainer of one experiment: which one it is, starting and stopping it, and the watchdog.

The watchdog asks the trainer it started for its status every `trainer_poll_interval_s`: a
trainer that failed, or restarted (idle, not running this experiment), or an experiment without
progress for `progress_timeout_s`, is a reason to start it again (the runner enters
RESTARTING); too many failures in a row, or no progress twice in a row, a reason to give up
(FAILING) -- an experiment is never RUNNING in silence. A trainer lost or replaced the runner
sees itself (`changed`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from asyncrl.logging import raise_if_cancelled
from asyncrl.storage import is_storage_full
from asyncrl.types import TrainerState
from asyncrl.v1 import trainer_pb2, trainer_pb2_grpc
from services.scheduler.calls import WorkerCalls
from services.scheduler.config import SchedulerConfig
from services.scheduler.context import ChannelPool
from services.scheduler.lifecycle import Lifecycle, Phase
from services.scheduler.registry import Registry, Worker, WorkerKind


class TrainerStartFailed(Exception):
    """StartExperiment failed: `fatal` (INVALID_ARGUMENT, or max_start_failures reached) fails
    the experiment with this message; otherwise the trainer was unbound and another one may be
    started."""

    def __init__(self, message: str, fatal: bool):
        super().__init__(message)
        self.fatal = fatal


class TrainerSupervisor:
    def __init__(
        self,
        experiment_id: str,
        registry: Registry,
        calls: WorkerCalls,
        channels: ChannelPool,
        config: SchedulerConfig,
        lifecycle: Lifecycle,
        log,
    ):
        self.experiment_id = experiment_id
        self.registry = registry
        self.calls = calls
        self.channels = channels
        self.config = config
        self.lifecycle = lifecycle
        self.log = log
        self.trainer_id: str | None = None
        """The trainer StartExperiment last succeeded on (any other bound trainer is started)."""
        self.started: Worker | None = None
        """That trainer: it may still commit (to be told to stop) once it is no longer bound."""
        self.known = asyncio.Event()
        """Set once a trainer was started (a trainer's call waits for it after a restart)."""
        self._start_failures = 0
        self.paused = ""
        """Why the run is paused: the trainer's storage is full ("" when it is not)."""
        self._failures = 0
        """Failures the trainer reported since the last commit."""
        self._poll_now = asyncio.Event()
        self._stalled = False
        self._mark: tuple = ()
        self._moved_at = time.monotonic()

    def bound(self) -> Worker | None:
        """The trainer bound to the experiment, if any."""
        bound = self.registry.bound(self.experiment_id, WorkerKind.TRAINER)
        return bound[0] if bound else None

    def changed(self) -> str:
        """Why a trainer must be started again ("" while the one started is bound)."""
        trainer = self.bound()
        if trainer is None:
            return "trainer lost"
        if trainer.worker_id != self.trainer_id:
            return f"trainer {trainer.worker_id} replaced {self.trainer_id}"
        return ""

    # ---- start and stop ----------------------------------------------------------------------

    async def start(self, trainer: Worker) -> trainer_pb2.StartExperimentResponse | None:
        """StartExperiment on `trainer`: its answer (the version it resumes from), None if its
        lease lapsed meanwhile; TrainerStartFailed if the call failed."""
        try:
            resp = await self.calls.start_trainer(trainer, self.config.trainer_start_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise self._start_failed(trainer, e) from e
        if self.bound() is not trainer:
            return None  # its lease lapsed while it was starting
        self._start_failures = 0
        self.trainer_id, self.started = trainer.worker_id, trainer
        self.known.set()
        self._moved_at = time.monotonic()
        return resp

    def _start_failed(self, trainer: Worker, e: grpc.aio.AioRpcError) -> TrainerStartFailed:
        """INVALID_ARGUMENT is fatal; a busy trainer (FAILED_PRECONDITION) is only unbound;
        other errors are fatal after max_start_failures."""
        storage = is_storage_full(e.details() or "")
        if storage:  # not the trainer's fault: the run pauses until space returns
            self.paused = f"trainer {trainer.worker_id}: {e.details()}"
        elif self.paused and e.code() != grpc.StatusCode.INVALID_ARGUMENT:
            storage = True  # NATS still recovering from the full disk (nats: timeout)
        elif e.code() != grpc.StatusCode.FAILED_PRECONDITION:
            self._start_failures += 1
        self.log.warning(
            "trainer_start_failed",
            worker=trainer.worker_id,
            code=e.code().name,
            details=e.details(),
            failures=self._start_failures,
        )
        fatal = (
            e.code() == grpc.StatusCode.INVALID_ARGUMENT
            or self._start_failures >= self.config.max_start_failures
        )
        if fatal:
            return TrainerStartFailed(
                f"trainer could not start the experiment: {e.details()}", True
            )
        self.registry.unbind(trainer, self.config.fence_cooldown_s)
        if storage:
            return TrainerStartFailed(f"paused: {self.paused}", False)
        return TrainerStartFailed(
            f"trainer {trainer.worker_id} failed to start: {e.details()}", False
        )

    async def stop(self) -> None:
        """The run ends: stop the bound trainer, then free it (stopped before it is freed, so
        no other experiment races it)."""
        trainer = self.bound()
        if trainer is None:
            return
        try:
            await self.calls.stop_trainer(trainer, self.config.trainer_stop_timeout_s)
        except grpc.aio.AioRpcError as e:
            self.log.warning("trainer_stop_failed", worker=trainer.worker_id, code=e.code().name)
        self.registry.unbind(trainer)

    def committed(self) -> None:
        """A commit: the trainer works (its failures in a row start again from 0; a pause for
        storage is over)."""
        self._failures = 0
        if self.paused:
            self.log.info("experiment_resumed", after=self.paused)
            self.paused = ""

    # ---- the watchdog ------------------------------------------------------------------------

    def check_soon(self) -> None:
        """The bound trainer registered again (it may have restarted): ask it now."""
        self._poll_now.set()

    async def watch(
        self,
        progress: Callable[[], tuple[tuple, str]],
        act: Callable[[str, str], None],
    ) -> None:
        """While RUNNING, poll the trainer and `progress` (a mark that changes whenever the
        run moves, and what it is waiting for); a reason to act is `act(why, fail)`: start the
        trainer again, or give up with `fail` when it is not ""."""
        while True:
            raise_if_cancelled("trainer watchdog")
            try:
                await asyncio.wait_for(self._poll_now.wait(), self.config.trainer_poll_interval_s)
            except TimeoutError:
                pass
            self._poll_now.clear()
            if self.lifecycle.phase is not Phase.RUNNING:
                continue
            why, fail = await self._check_trainer()
            if not why:
                why, fail = self._check_progress(*progress())
            if why and self.lifecycle.phase is Phase.RUNNING:  # not finishing meanwhile
                act(why, fail)

    async def _check_trainer(self) -> tuple[str, str]:
        """Why the trainer started must be started again ("" if it runs fine), and why the
        run must fail instead ("" unless it failed too often in a row)."""
        trainer = self.bound()
        if trainer is None or trainer.worker_id != self.trainer_id:
            return "", ""  # the dispatch loop sees that itself
        stub = trainer_pb2_grpc.TrainerStub(self.channels.get(trainer.address))
        try:
            status = await stub.GetStatus(
                trainer_pb2.GetTrainerStatusRequest(), timeout=self.config.trainer_poll_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            self.log.warning("trainer_status_failed", worker=trainer.worker_id, code=e.code().name)
            return "", ""  # dead or busy: its lease decides
        state = TrainerState.reported(status.state)
        mine = status.experiment_id == self.experiment_id
        if mine and state == TrainerState.FAILED and is_storage_full(status.message):
            self.paused = f"trainer {trainer.worker_id}: {status.message}"
        if mine and state == TrainerState.FAILED and self.paused:  # also NATS recovering after
            return f"paused: {self.paused}", ""  # started again, never counted as failing
        if mine and state == TrainerState.FAILED and status.fatal:
            return f"trainer {trainer.worker_id} failed: {status.message}", status.message
        if mine and state == TrainerState.FAILED:
            self._failures += 1
            why = f"trainer {trainer.worker_id} failed: {status.message or 'no message'}"
            if self._failures >= self.config.max_start_failures:
                return why, f"{why} ({self._failures} failures in a row)"
            return why, ""
        if not mine or not state.active:
            return (
                f"trainer {trainer.worker_id} is {state.value}, not running {self.experiment_id}",
                "",
            )
        return "", ""

    def _check_progress(self, mark: tuple, waiting: str) -> tuple[str, str]:
        """A reason if `mark` did not move for progress_timeout_s; the second time in a row
        (after the trainer was started again) also a reason to fail."""
        now = time.monotonic()
        if mark != self._mark:
            self._mark, self._moved_at, self._stalled = mark, now, False
            return "", ""
        idle_s = now - self._moved_at
        if idle_s < self.config.progress_timeout_s:
            return "", ""
        why = f"no progress for {idle_s:.0f}s: {waiting}"
        fail = why + ", also after the trainer was started again" if self._stalled else ""
        self._stalled, self._moved_at = True, now
        return why, fail
