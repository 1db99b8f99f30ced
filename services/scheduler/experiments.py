"""One asyncio runner per experiment: wait for workers, start the trainer, dispatch groups under
the staleness rule, broadcast committed weights, abort what became too stale, evaluate, finish.

A commit is answered as soon as it is recorded: the trainer goes on with its next step while
`_update_fleet` (one background task at a time) brings the ready rollouts to the newest
committed version. Commits that land during an update coalesce into the next one. The fleet
version, which admission uses, moves only once an update is done; stale aborts use the
committed version, the trainer's; no training group starts while the fleet is behind it (it
would start staler than admission assumes); a commit is answered once the fleet is at most
`fleet_lag` versions behind. Periodic and final evals run on the fleet, once it serves their
version.

The loop top to bottom (`_run`): wait until a trainer, a rollout and a reward worker are there;
`StartExperiment` tells the version to resume from; then dispatch (`Dispatcher`) while the
staleness manager has capacity, woken by every event (a group finished, a commit, a worker
joined) -- never by polling. Beside it a watchdog (`_watch`) asks the trainer it started for its
status every `trainer_poll_interval_s`: a trainer that failed, was replaced or restarted (idle,
not running this experiment), or an experiment without progress for `progress_timeout_s`, sends
the loop back to `_start_trainer` (resume from the trainer's checkpoint), or ends it FAILED with
the reason -- an experiment is never RUNNING in silence.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from asyncrl.ledger import Ledger
from asyncrl.logging import get_logger
from asyncrl.spec import ExperimentSpec
from asyncrl.types import EvalResult, StepMetrics
from services.scheduler.authority import TrainerAuthority
from services.scheduler.calls import BindRefused, WorkerCalls
from services.scheduler.context import RunnerContext
from services.scheduler.dataset import Prompt
from services.scheduler.dispatch import Dispatcher, DispatchHooks
from services.scheduler.fleet import Fleet, FleetHooks, FleetUpdate, fleet_lag
from services.scheduler.lifecycle import Lifecycle, Phase
from services.scheduler.policy import StalenessManager
from services.scheduler.progress import ProgressBook
from services.scheduler.records import (
    CommitResult,
    Event,
    ExperimentRecord,
    ExperimentState,
)
from services.scheduler.registry import Worker, WorkerKind
from services.scheduler.supervisor import TrainerStartFailed, TrainerSupervisor


class ExperimentRunner:
    def __init__(
        self,
        record: ExperimentRecord,
        spec: ExperimentSpec,
        prompts: list[Prompt],
        eval_prompts: list[Prompt],
        ctx: RunnerContext,
    ):
        self.record = record
        self.spec = spec
        self.eval_prompts = eval_prompts
        self.ctx = ctx
        self.config = ctx.config
        self.registry = ctx.registry
        self.log = get_logger(experiment=record.id)
        self.calls = WorkerCalls(record.id, spec, ctx.channels)
        self.lifecycle = Lifecycle(record)
        hooks = FleetHooks(fence=self._fence, refused=self._refused, moved=self._fleet_moved)
        self.fleet = Fleet(
            self.calls, record, ctx.registry, self.lifecycle, hooks, ctx.fleet_seconds, self.log
        )
        self.book = ProgressBook(record, ctx.history, self.log)
        hooks = DispatchHooks(changed=self._changed, fence=self._fence, eval_done=self._eval_done)
        self.dispatcher = Dispatcher(
            record,
            spec,
            prompts,
            eval_prompts,
            self.calls,
            ctx.registry,
            hooks,
            self.log,
            lambda: self.version,
            Ledger(ctx.js, record.id),
        )
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # the dispatch loop waits for an event, nothing dispatchable
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.supervisor = TrainerSupervisor(
            record.id, ctx.registry, self.calls, ctx.channels, ctx.config, self.lifecycle, self.log
        )
        self.authority = TrainerAuthority(
            record.id, ctx.registry, self.supervisor, self.lifecycle, self.log
        )

    # ---- views -------------------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def version(self) -> int:
        """The fleet version: the weights the rollouts serve."""
        return self.fleet.version

    @property
    def committed_version(self) -> int:
        """The trainer's newest committed version (the fleet loads it after the commit)."""
        return self.fleet.committed_version

    @property
    def state(self) -> ExperimentState:
        return self.record.state

    @property
    def terminal(self) -> bool:
        return self.lifecycle.terminal

    @property
    def finishing(self) -> bool:
        return self.lifecycle.phase is Phase.FINISHING

    @property
    def ending(self) -> bool:
        """Entering its terminal state: takes no more workers."""
        return self.lifecycle.phase is Phase.ENDING

    def trainer(self) -> Worker | None:
        return self.supervisor.bound()

    def rollouts(self) -> list[Worker]:
        return self.registry.bound(self.id, WorkerKind.ROLLOUT)

    @property
    def staleness(self) -> StalenessManager:
        return self.dispatcher.staleness

    def snapshot(self) -> ExperimentRecord:
        """The record with its progress made now (what is persisted and served)."""
        d = self.dispatcher
        rate = d.throughput.rate()
        self.record.progress = self.book.progress(d.staleness.counts, self.version, d.cursor, rate)
        self.record.fleet_uri = self.fleet.uri
        d.save_into(self.record)
        return self.record

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if not self.terminal:
            self._task = asyncio.create_task(self._run(), name=f"experiment-{self.id}")

    async def cancel(self) -> None:
        await self._end(Phase.CANCELLED, "cancelled by user")

    def abandon(self, message: str) -> None:
        """A persisted experiment that cannot resume (its dataset is gone): FAILED, never
        started (nothing is bound to it yet)."""
        self.lifecycle.to(Phase.ENDING)
        self.lifecycle.to(Phase.FAILED, message=message)

    async def shutdown(self) -> None:
        """The scheduler is stopping: stop all tasks and keep the state as it is (it resumes,
        and the groups in flight are in the snapshot)."""
        tasks = [t for t in (self._task, *self._background) if t is not None]
        tasks += self.dispatcher.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.book.close()

    async def _run(self) -> None:
        """PENDING -> BINDING -> STARTING -> RUNNING (dispatch, under the watchdog) until the
        run ends; back to PENDING when the trainer is lost or must be started again."""
        try:
            while not self.terminal:
                if self.lifecycle.phase is Phase.FAILING:  # the watchdog gave up on the trainer
                    await self._end(Phase.FAILED, self.lifecycle.reason)
                    return
                if self.finishing or await self._prepare():
                    watch = self.supervisor.watch(self._progress_mark, self._trainer_verdict)
                    watchdog = asyncio.create_task(watch, name=f"watchdog-{self.id}")
                    try:
                        await self._dispatch_loop()
                    finally:
                        watchdog.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug must fail the experiment visibly
            self.log.exception("experiment_runner_crashed")
            await self._end(Phase.FAILED, f"scheduler error: {type(e).__name__}: {e}")

    async def _prepare(self) -> bool:
        """Wait for workers, bind the reward workers, start the trainer: True once RUNNING
        (or finishing: a commit at total_steps landed meanwhile)."""
        why = self.lifecycle.reason if self.lifecycle.phase is Phase.RESTARTING else ""
        await self._wait_for_workers()
        if self.lifecycle.phase is not Phase.PENDING:  # finishing meanwhile
            return False
        await self._bind_rewards()
        if self.lifecycle.phase is not Phase.BINDING:  # a worker refused the spec
            return False
        return await self._start_trainer(why)

    def _missing_workers(self) -> list[str]:
        missing = []
        if self.trainer() is None:
            missing.append("a trainer")
        if not self.rollouts():
            missing.append("a rollout worker")
        if not self.registry.workers(WorkerKind.REWARD):
            missing.append("a reward worker")
        return missing

    async def _wait_for_workers(self) -> None:
        """Enter PENDING and return once a trainer, a rollout and a reward worker are there
        (or the run began finishing meanwhile)."""
        if self.lifecycle.phase is not Phase.PENDING:
            self._enter(Phase.PENDING)
        while self.lifecycle.phase is Phase.PENDING:
            self._wake.clear()
            missing = self._missing_workers()
            if not missing:
                return
            message = "waiting for " + ", ".join(missing)
            if message != self.record.message:
                self.record.message = message
                self.log.info("experiment_waiting", missing=missing)
                self._persist()
            await self._wake.wait()

    async def _start_trainer(self, why: str) -> bool:
        """StartExperiment -> version k (0 or a checkpoint): the fleet resumes at k."""
        trainer = self.trainer()
        if trainer is None:
            return False
        message = f"starting trainer {trainer.worker_id}" + (f" ({why})" if why else "")
        self._enter(Phase.STARTING, message=message)
        self._persist()
        try:
            resp = await self.supervisor.start(trainer)
        except TrainerStartFailed as e:
            if e.fatal:
                await self._end(
                    Phase.FAILED, f"trainer could not start the experiment: {e.details}"
                )
            else:
                self.record.message = str(e)
                self.ctx.workers_changed()
            return False
        if resp is None:
            return False
        k = resp.version
        await self.fleet.resume_at(k, resp.uri)
        if self.lifecycle.phase is Phase.STARTING:  # else finishing: a commit landed meanwhile
            self._enter(Phase.RUNNING, message="")
        else:
            self.record.message = ""
        self.log.info(
            "experiment_started", version=k, resumed=resp.resumed, worker=trainer.worker_id
        )
        for w in self.rollouts():
            if w.worker_id not in self.fleet.ready:
                self._spawn(self.fleet.join(w, self.config.bind_timeout_s))
        self._maybe_eval(k, start=True)
        if k >= self.spec.trainer.total_steps:
            self._begin_finish(f"trainer is at version {k} >= total_steps")
        return True

    async def _bind_rewards(self) -> None:
        """Send the spec to every reward worker before the trainer starts: a worker that cannot
        load the reward function refuses it (INVALID_ARGUMENT) and the experiment fails with
        its message. Any other error is left to the rollouts, which bind it again anyway."""
        self._enter(Phase.BINDING)
        addresses = self.registry.reward_addresses()
        timeout = self.config.bind_timeout_s
        results = await asyncio.gather(
            *(self.calls.bind_reward(a, timeout) for a in addresses), return_exceptions=True
        )
        for address, result in zip(addresses, results, strict=True):
            if isinstance(result, BindRefused):
                await self._end(Phase.FAILED, f"reward worker {address} {result}")
                return
            if isinstance(result, grpc.aio.AioRpcError):
                self.log.warning(
                    "reward_bind_failed",
                    address=address,
                    code=result.code().name,
                    details=result.details(),
                )
            elif isinstance(result, BaseException):
                raise result

    # ---- dispatch ----------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        """Dispatch until the experiment ends or its trainer is lost."""
        dispatched = 0
        while True:
            self._wake.clear()
            phase = self.lifecycle.phase
            if not self.lifecycle.live:
                return
            if phase is Phase.FINISHING:
                if self.dispatcher.evaluator.idle and self.version >= self.committed_version:
                    await self._end(*self._outcome())
                    return
            elif why := self._trainer_changed():
                self.log.warning(
                    "trainer_redrive",
                    reason=why,
                    version=self.version,
                    running=len(self.dispatcher.inflight),
                )
                return
            elif self.dispatcher.dataset_done(self.committed_version):
                self._begin_finish("dataset exhausted")
                continue
            ready = self.fleet.ready_rollouts()
            training = (
                phase is Phase.RUNNING
                and self.version >= self.committed_version  # never on weights already stale
            )
            if self.dispatcher.dispatch_one(ready, self.registry.reward_addresses(), training):
                dispatched += 1
                if dispatched % 32 == 0:
                    await asyncio.sleep(0)  # let the started calls go out
                continue
            self._idle.set()
            await self._wake.wait()
            self._idle.clear()

    def _trainer_changed(self) -> str:
        """Why the loop must start a trainer again; "" while the one it started runs."""
        if self.lifecycle.phase in (Phase.RESTARTING, Phase.FAILING):  # the watchdog's word
            return self.lifecycle.reason
        return self.supervisor.changed()

    async def settled(self) -> None:
        """Return once the dispatch loop has handled every event so far and waits for the next
        one with nothing it may dispatch (after it, `progress.dispatched` stays put until the
        next event)."""
        while True:
            if self._wake.is_set():
                self._idle.clear()  # an event is pending: the loop has a pass to run first
            await self._idle.wait()
            if not self._wake.is_set():
                return

    def _changed(self) -> None:
        self._wake.set()
        self._persist()

    # ---- watchdog ---------------------------------------------------------------------------

    def _progress_mark(self) -> tuple[tuple, str]:
        """What moves while the run makes progress (a commit, a group settled, an eval, a
        rollout joining), and what it waits for; the watchdog acts when it stands still."""
        s = self.staleness.counts
        mark = (self.version, self.committed_version, s.accepted, s.rejected, s.failed)
        mark += (s.stale_dropped, len(self.record.evals), len(self.fleet.ready))
        waiting = (
            f"no step committed after v{self.version} and no group settled ({s.running}"
            f" running on {len(self.fleet.ready)} ready rollouts)"
        )
        return mark, waiting

    def _trainer_verdict(self, why: str, fail: str) -> None:
        """The watchdog: start the trainer again (`why`), or end the run FAILED (`fail`)."""
        self.log.warning("trainer_check_failed", reason=why, fail=fail)
        self._enter(Phase.FAILING if fail else Phase.RESTARTING, reason=fail or why)
        self._wake.set()

    # ---- workers -----------------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def _fence(self, worker: Worker, reason: str) -> None:
        self.release_rollout(worker, reason, self.config.fence_cooldown_s)

    def attach_rollout(self, worker: Worker) -> None:
        """`worker` was bound here (or registered again): it loads the fleet's weights first."""
        self.fleet.ready.discard(worker.worker_id)
        if self.state == ExperimentState.RUNNING:
            self._spawn(self.fleet.join(worker, self.config.bind_timeout_s))

    async def _refused(self, reason: str) -> None:
        await self._end(Phase.FAILED, reason)

    def release_rollout(self, worker: Worker, reason: str, cooldown_s: float = 0.0) -> None:
        """Unbind (fence) a rollout; its in-flight groups are cancelled and re-queued."""
        if worker.experiment_id != self.id:
            return
        self.registry.unbind(worker, cooldown_s)
        self.fleet.ready.discard(worker.worker_id)
        requeued = self.dispatcher.requeue_worker(worker)
        self.log.warning(
            "rollout_fenced", worker=worker.worker_id, reason=reason, requeued=requeued
        )
        self._wake.set()
        self._persist()
        self.ctx.workers_changed()

    def rollout_lost(self, worker: Worker) -> None:
        """Its lease lapsed: in-flight groups count as failed RPCs (prompts re-queued)."""
        self.release_rollout(worker, "lease expired")

    def trainer_lost(self, worker: Worker) -> None:
        self.log.warning("trainer_lease_expired", worker=worker.worker_id, version=self.version)
        self._wake.set()

    # ---- trainer calls -----------------------------------------------------------------------

    async def commit(self, version: int, uri: str, metrics: StepMetrics) -> CommitResult:
        """Record `version` (durable in the weight store) as the trainer's newest and answer at
        once: abort groups that can no longer be trained within eta, record the step, finish
        at total_steps. The ready rollouts load it in the background (`_update_fleet`).
        The caller was authorized first (`TrainerAuthority.authorize`)."""
        t0 = time.perf_counter()
        over = self.lifecycle.stopping
        if over or version <= self.committed_version:  # a retry, or late
            return CommitResult(self.version, 0, 0, over)
        self.fleet.commit(version, uri, self._spawn)
        self.supervisor.committed()
        aborted = self.dispatcher.abort_stale(version)
        if aborted:
            self.log.info(
                "groups_aborted_stale",
                version=version,
                aborted=aborted,
                eta=self.spec.rollout.max_head_offpolicyness,
            )
        metrics.version = version
        self.fleet.into_metrics(metrics)
        self.book.add_step(metrics)
        self.log.info(
            "version_committed",
            version=version,
            uri=uri,
            fleet_version=self.version,
            loss=metrics.loss,
            reward_mean=metrics.reward_mean,
            groups=metrics.groups,
        )
        if version >= self.spec.trainer.total_steps:
            self._begin_finish(f"reached total_steps={self.spec.trainer.total_steps}")
        elif self.dispatcher.dataset_done(self.committed_version):
            self._begin_finish("dataset exhausted")
        self._wake.set()
        self._persist()
        self.fleet.commit_took(time.perf_counter() - t0)
        await self.fleet.reaches(version - fleet_lag(self.spec.rollout), version)
        return CommitResult(self.version, 0, 0, self.lifecycle.stopping)

    def _fleet_moved(self, update: FleetUpdate | None) -> None:
        """A rollout became ready, or the fleet serves a new version: evaluate it if due."""
        if update is not None:
            if not self.lifecycle.stopping:
                self._maybe_eval(update.version, since=update.previous)
            elif update.version >= self.committed_version:
                self._maybe_eval(update.version, final=True)
            self._persist()
        self._wake.set()

    def report_dropped(self, group_ids: list[str]) -> int:
        """The trainer dropped accepted groups as too stale: free capacity, re-queue prompts.
        A group id the scheduler did not dispatch and accept for this experiment is a
        BadRequest naming `groups` (nothing is changed, the run goes on)."""
        requeued = self.dispatcher.report_dropped(group_ids)
        if requeued:
            self.log.info("groups_dropped_by_trainer", requeued=requeued, version=self.version)
        self._changed()
        return requeued

    # ---- eval and the end --------------------------------------------------------------------

    def _maybe_eval(
        self, version: int, *, start: bool = False, final: bool = False, since: int | None = None
    ) -> None:
        """Evaluate `version` if due (or if one of the versions after `since` the fleet skipped
        was)."""
        if self.dispatcher.evaluator.schedule(version, start=start, final=final, since=since):
            self.log.info("eval_started", version=version, prompts=len(self.eval_prompts))
            self._wake.set()

    def _eval_done(self, result: EvalResult) -> None:
        self.book.add_eval(result)
        self._persist()

    def _begin_finish(self, reason: str) -> None:
        """Stop training dispatch, cancel training groups in flight (not counted as drops), and
        run the final eval; the dispatch loop completes the experiment once evals are done."""
        if self.lifecycle.stopping:
            return
        self._enter(Phase.FINISHING, reason=reason)
        batch = self.spec.trainer.batch_size
        untrained = self.staleness.counts.accepted - self.committed_version * batch
        self.book.left_over = max(0, untrained)
        cancelled = self.dispatcher.cancel(training_only=True)
        self.log.info(
            "experiment_finishing", reason=reason, version=self.version, cancelled=cancelled
        )
        if self.version >= self.committed_version:  # else once the fleet serves the last one
            self._maybe_eval(self.version, final=True)
        self._wake.set()
        self._persist()

    def _outcome(self) -> tuple[Phase, str]:
        """COMPLETED with the finish reason (and the groups left over), or FAILED when no step
        was trained, saying what happened to the groups."""
        p, batch = self.snapshot().progress, self.spec.trainer.batch_size
        reason = finish_reason = self.lifecycle.reason  # FINISHING's
        if p.left_over:
            reason += f"; {p.left_over} accepted groups left over, never trained"
        if self.version > 0 or self.record.history:
            return Phase.COMPLETED, reason
        counts = (
            f"{p.accepted} groups accepted (batch_size={batch}), {p.rejected} filtered,"
            f" {p.failed} failed"
        )
        top = sorted(self.record.failure_reasons.items(), key=lambda kv: -kv[1])[:3]
        if top:
            counts += " (" + "; ".join(f"{n}x {why}" for why, n in top) + ")"
        return Phase.FAILED, f"trained nothing: {finish_reason}: {counts}"

    async def _end(self, phase: Phase, message: str) -> None:
        """ENDING, then the terminal `phase`: stop everything, free the workers, stop the
        trainer, and only then say so, so a client that sees the end also sees the trainer's
        last ledger events (what it left over) and its final checkpoint."""
        if not self.lifecycle.live:
            return
        self._enter(Phase.ENDING)  # a commit meanwhile is told to stop
        self.fleet.notify()
        self.dispatcher.cancel(training_only=False)
        current = asyncio.current_task()
        for t in (self._task, *self._background):
            if t is not None and t is not current:
                t.cancel()
        for w in self.rollouts():
            self.registry.unbind(w)
        self.fleet.ready.clear()
        await self.supervisor.stop()
        await self.dispatcher.ledger.flush()
        for w in self.rollouts():  # bound while the trainer stopped (still live, finishing):
            self.registry.unbind(w)  # a terminal experiment must hold no worker
        self._enter(phase, message=message)
        self.log.info(
            "experiment_ended", state=self.state.value, message=message, version=self.version
        )
        self.ctx.workers_changed()

    # ---- plumbing ----------------------------------------------------------------------------

    def _enter(self, phase: Phase, reason: str = "", message: str | None = None) -> None:
        """The one way the runner changes phase (`Lifecycle.to` refuses an illegal one); a
        change of the public state is persisted and told to watchers."""
        if self.lifecycle.to(phase, reason, message):
            self._persist()
            self.book.emit(Event("state"))

    def _persist(self) -> None:
        self.record.updated_unix_ms = int(time.time() * 1000)
        self.ctx.store.mark_dirty(self.id, self.snapshot)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error(
                "background_task_failed", task=task.get_name(), error=repr(task.exception())
            )
