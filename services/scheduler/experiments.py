"""One asyncio runner per experiment: its lifecycle (`lifecycle.Lifecycle`, one transition
table) and the loop that drives it, over the parts that each do one job:

    fleet.Fleet                     which rollouts serve which weights; weight updates
    dispatch.Dispatcher             admission under the staleness rule, each group's outcome
    supervisor.TrainerSupervisor    starting and stopping the trainer; the watchdog
    authority.TrainerAuthority      who may commit or report drops for the experiment
    commits.CommitHandler           what a commit does; evals; the finish
    progress.ProgressBook           steps, evals, watchers; the one maker of a Progress

The loop top to bottom (`_run`): PENDING until a trainer, a rollout and a reward worker are
there; BINDING sends the spec to the reward workers; STARTING: `StartExperiment` tells the
version to resume from; RUNNING dispatches while the staleness manager has capacity, woken by
every event (a group finished, a commit, a worker joined) -- never by polling. Beside it the
watchdog polls the trainer: RESTARTING goes back to PENDING (the trainer is started again from
its checkpoint), FAILING ends the run FAILED. FINISHING runs the final eval; ENDING stops the
trainer and frees the workers before the terminal state is shown.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

from asyncrl.errors import Unavailable
from asyncrl.ledger import Ledger, read_events, summarize, unaccounted
from asyncrl.logging import get_logger
from asyncrl.runlog import RunLog, run_dir
from asyncrl.spec import ExperimentSpec
from asyncrl.types import EvalResult
from services.scheduler.authority import TrainerAuthority
from services.scheduler.calls import BindRefused, WorkerCalls
from services.scheduler.commits import CommitHandler, RunnerHooks, left_over_note
from services.scheduler.context import RunnerContext
from services.scheduler.dataset import Prompt
from services.scheduler.dispatch import Dispatcher, DispatchHooks
from services.scheduler.fleet import Fleet, FleetHooks
from services.scheduler.lifecycle import Lifecycle, Phase
from services.scheduler.policy import StalenessManager
from services.scheduler.progress import ProgressBook
from services.scheduler.records import (
    Event,
    ExperimentRecord,
    ExperimentState,
)
from services.scheduler.registry import Worker, WorkerKind
from services.scheduler.supervisor import TrainerStartFailed, TrainerSupervisor

LEDGER_FLUSH_S = 5.0
"""A stopping scheduler waits this long at most for each runner's ledger events to be stored."""
CRASH_END_ATTEMPTS = 5
CRASH_RETRY_S = 2.0


async def close_ledger(ledger: Ledger, js, experiment_id: str, untrained: int, log) -> int | None:
    """The run's prompts left over, as `asyncrl ledger` counts them (the one figure the final
    message and `progress.left_over` give), read once the trainer stopped and the runner's
    events are stored: of the `untrained` groups (accepted, in no committed step), those no
    one wrote as left over are written so first (`ledger.unaccounted`). None when the ledger
    cannot be read (NATS away)."""
    try:
        report = summarize(await asyncio.wait_for(read_events(js, experiment_id), LEDGER_FLUSH_S))
        groups = unaccounted(report, untrained)
        if groups:
            reason = "accepted, trained by no step when the run ended"
            record = ledger.record("left_over", groups=groups, reason=reason)
            await asyncio.wait_for(record, LEDGER_FLUSH_S)
    except Exception as e:  # noqa: BLE001 - NATS away: the runner's estimate stands
        log.warning("ledger_not_closed", error=f"{type(e).__name__}: {e}")
        return None
    return report.totals["left_over"] + len(groups)


def eval_done(runner: ExperimentRunner, result: EvalResult) -> None:
    """An eval round finished: record it; the fleet may take the newest version again."""
    runner.book.add_eval(result)
    if runner.dispatcher.evaluator.idle:
        runner.fleet.catch_up(runner._spawn)


async def final_left_over(runner: ExperimentRunner) -> int:
    """The ended run's prompts left over: the ledger's count (`close_ledger`), else the
    runner's estimate when the ledger cannot be read."""
    untrained = max(0, runner.staleness.counts.accepted - runner.book.trained_groups)
    ledger = runner.dispatcher.ledger
    left_over = await close_ledger(ledger, runner.ctx.js, runner.id, untrained, runner.log)
    if left_over is None:
        return runner.dispatcher.left_over_at_end(runner.book.trained_groups)
    return left_over


async def flush_ledger(ledger: Ledger, log) -> None:
    """Store what the runner emitted (its cancelled tasks included) before NATS closes: a
    prompt is left "in flight" in a finished run's ledger otherwise. At most LEDGER_FLUSH_S."""
    try:
        await asyncio.wait_for(ledger.flush(), LEDGER_FLUSH_S)
    except TimeoutError:
        log.warning("ledger_flush_timeout", seconds=LEDGER_FLUSH_S)


async def end_after_crash(end: Callable[[], Awaitable[None]], log) -> None:
    """`end()` the crashed run (FAILED), again (a broker away, a full disk) until it is
    recorded: a crashed runner never leaves its experiment RUNNING in silence."""
    for attempt in range(1, CRASH_END_ATTEMPTS + 1):
        try:
            await end()
            return
        except Exception as e:  # noqa: BLE001 - logged, tried again
            log.exception("experiment_end_failed", attempt=attempt, error=repr(e))
            await asyncio.sleep(CRASH_RETRY_S)


def bind_refusal(errors: dict[str, BindRefused | grpc.aio.AioRpcError], log) -> str:
    """Why the experiment must fail after binding its reward workers ("" if it goes on): a
    worker that cannot load the reward function refused the spec (INVALID_ARGUMENT), named with
    its message. Any other error is logged and left to the rollouts, which bind it again."""
    for address, e in errors.items():
        if isinstance(e, BindRefused):
            return f"reward worker {address} {e}"
        log.warning("reward_bind_failed", address=address, code=e.code().name, details=e.details())
    return ""


def waiting_message(missing: list[str], paused: str) -> str:
    """What a PENDING experiment waits for; a pause's reason (a full disk) stays visible while
    the trainer cools down."""
    message = "waiting for " + ", ".join(missing)
    return f"paused: {paused}; {message}" if paused else message


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
        self.ctx = ctx
        self.config = ctx.config
        self.registry = ctx.registry
        self.log = get_logger(experiment=record.id)
        self.calls = WorkerCalls(record.id, spec, ctx.channels)
        self.lifecycle = life = Lifecycle(record)
        runlog = RunLog(
            run_dir(record.id), spec.trainer.loggers, record.id, spec.model_dump(mode="json")
        )
        self.book = ProgressBook(record, ctx.history, runlog, self.log)
        moved = FleetHooks(
            fence=self._fence,
            refused=lambda reason: self._end(Phase.FAILED, reason),
            moved=lambda update: self.commits.fleet_moved(update),
        )
        self.fleet = Fleet(
            self.calls, record, ctx.registry, life, moved, ctx.fleet_seconds, self.log
        )
        self.fleet.announcer = ctx.announcer
        self.reward_slice: list[str] = []  # its reward workers (sharing.assign_rewards)
        hooks = {"changed": self._changed, "fence": self._fence, "freed": ctx.slot_freed}
        self.dispatcher = Dispatcher(
            record,
            spec,
            prompts,
            eval_prompts,
            self.calls,
            ctx.registry,
            DispatchHooks(**hooks, eval_done=lambda result: eval_done(self, result)),
            self.log,
            lambda: self.version,
            Ledger(ctx.js, record.id, ctx.held),
        )
        self.supervisor = TrainerSupervisor(
            record.id, ctx.registry, self.calls, ctx.channels, ctx.config, life, self.log
        )
        self.authority = TrainerAuthority(record.id, ctx.registry, self.supervisor, life, self.log)
        hooks = {"enter": self._enter, "changed": self._changed, "spawn": self._spawn}
        runner = RunnerHooks(**hooks, persist=self.persist_now)
        self.commits = CommitHandler(
            spec, life, self.book, self.fleet, self.dispatcher, self.supervisor, runner, self.log
        )
        if spec.eval.one_version:
            self.fleet.held = lambda: not self.dispatcher.evaluator.idle
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # the dispatch loop waits for an event, nothing dispatchable
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

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
        await flush_ledger(self.dispatcher.ledger, self.log)
        await self.book.close()

    async def _run(self) -> None:
        """PENDING -> BINDING -> STARTING -> RUNNING (dispatch, under the watchdog) until the
        run ends; back to PENDING when the trainer is lost or must be started again."""
        try:
            while not self.terminal:
                if self.lifecycle.phase is Phase.FAILING:  # the watchdog gave up on the trainer
                    await self._end(Phase.FAILED, self.lifecycle.reason)
                    return
                if self.finishing or await self._prepare():
                    watch = self.supervisor.watch(self._stall_mark, self._trainer_verdict)
                    watchdog = asyncio.create_task(watch, name=f"watchdog-{self.id}")
                    try:
                        await self._dispatch_loop()
                    finally:
                        watchdog.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug must fail the experiment visibly
            self.log.exception("experiment_runner_crashed")
            message = f"scheduler error: {type(e).__name__}: {e}"
            await end_after_crash(lambda: self._end(Phase.FAILED, message), self.log)

    async def _prepare(self) -> bool:
        """Wait for workers, bind the reward workers, start the trainer: True once RUNNING
        (or finishing: a commit at total_steps landed meanwhile)."""
        why = self.lifecycle.reason if self.lifecycle.phase is Phase.RESTARTING else ""
        await self._wait_for_workers()
        if self.lifecycle.phase is not Phase.PENDING:  # finishing meanwhile
            return False
        self._enter(Phase.BINDING)  # the spec to every reward worker before the trainer starts
        rewards = self.reward_slice or self.registry.reward_addresses()
        errors = await self.calls.bind_rewards(rewards, self.config.bind_timeout_s)
        if refused := bind_refusal(errors, self.log):
            await self._end(Phase.FAILED, refused)
        if self.lifecycle.phase is not Phase.BINDING:  # refused, or finishing meanwhile
            return False
        return await self._start_trainer(why)

    async def _wait_for_workers(self) -> None:
        """Enter PENDING and return once a trainer, a rollout and a reward worker are there
        (or the run began finishing meanwhile)."""
        if self.lifecycle.phase is not Phase.PENDING:
            self._enter(Phase.PENDING)
        while self.lifecycle.phase is Phase.PENDING:
            self._wake.clear()
            missing = self.registry.missing(self.id)
            if not missing:
                return
            message = waiting_message(missing, self.supervisor.paused)
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
                await self._end(Phase.FAILED, str(e))
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
        worker = trainer.worker_id
        self.log.info("experiment_started", version=k, resumed=resp.resumed, worker=worker)
        for w in self.rollouts():
            if w.worker_id not in self.fleet.ready:
                self._spawn(self.fleet.join(w, self.config.bind_timeout_s))
        self.commits.maybe_eval(k, start=True)
        if k >= self.spec.trainer.total_steps:
            self.commits.begin_finish(f"trainer is at version {k} >= total_steps")
        return True

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
                    await self._end(*self.commits.outcome())
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
                self.commits.begin_finish("dataset exhausted")
                continue
            ready = self.fleet.ready_rollouts()
            training = (
                phase is Phase.RUNNING
                and self.version >= self.committed_version  # never on weights already stale
                and not self._first_eval_holds()
            )
            rewards = self.reward_slice or self.registry.reward_addresses()
            if self.dispatcher.dispatch_one(ready, rewards, training):
                dispatched += 1
                if dispatched % 32 == 0:
                    await asyncio.sleep(0)  # let the started calls go out
                continue
            self._idle.set()
            await self._wake.wait()
            self._idle.clear()

    def _first_eval_holds(self) -> bool:
        """`eval.before_training`: the first eval round is still open."""
        return self.spec.eval.before_training and self.dispatcher.evaluator.first is not None

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

    def _stall_mark(self) -> tuple[tuple, str]:
        evaluator = self.dispatcher.evaluator
        return self.book.stall_mark(self.staleness.counts, self.fleet, evaluator.samples)

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

    def release_rollout(self, worker: Worker, reason: str, cooldown_s: float = 0.0) -> None:
        """Unbind (fence) a rollout; its in-flight groups are cancelled and re-queued."""
        if not self.registry.serves(worker, self.id):
            return
        self.registry.release(worker, self.id, cooldown_s)
        self.fleet.fenced(worker.worker_id, reason)
        n = self.dispatcher.requeue_worker(worker)
        self.log.warning("rollout_fenced", worker=worker.worker_id, reason=reason, requeued=n)
        self._wake.set()
        self._persist()
        self.ctx.workers_changed()

    def trainer_lost(self, worker: Worker) -> None:
        self.log.warning("trainer_lease_expired", worker=worker.worker_id, version=self.version)
        self._wake.set()

    # ---- the end -----------------------------------------------------------------------------

    async def _end(self, phase: Phase, message: str) -> None:
        """ENDING, then the terminal `phase`: stop everything, free the workers, stop the
        trainer, and only then say so, so a client that sees the end also sees the trainer's
        last ledger events (what it left over) and its final checkpoint."""
        if not self.lifecycle.live:
            return
        self._enter(Phase.ENDING)  # a commit meanwhile is recorded and told to stop
        self.fleet.notify()
        self.dispatcher.cancel(training_only=False)
        current = asyncio.current_task()
        for t in (self._task, *self._background):
            if t is not None and t is not current:
                t.cancel()
        for w in self.rollouts():
            self.registry.release(w, self.id)
        self.fleet.ready.clear()
        await self.supervisor.stop()
        await self.dispatcher.ledger.flush()
        for w in self.rollouts():  # bound while the trainer stopped (still live, finishing):
            self.registry.release(w, self.id)  # a terminal experiment must hold no worker
        await self.book.close_logs()  # complete when a client sees the end
        self.book.left_over = await final_left_over(self)
        message = left_over_note(phase, message, self.book.left_over)
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

    async def persist_now(self) -> None:
        """Return once the record is stored; Unavailable when it cannot be now (NATS away: at
        once, the caller retries; the record stays marked and is written once NATS is back)."""
        self._persist()
        await self.ctx.store.flush()
        if not self.ctx.store.stored(self.id):
            raise Unavailable("the experiment's state cannot be stored now (NATS unavailable)")

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
