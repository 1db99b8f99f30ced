"""What the trainer's calls do to a run, and how it finishes.

A commit is answered as soon as it is recorded (in the stored record too): abort the groups that can no longer be trained
within eta, record the step, finish at total_steps; the fleet loads the version in the
background (`Fleet.update`) and the answer waits only until the fleet is at most `fleet_lag`
versions behind. Evals run on the fleet once it serves their version: at the start, every
`eval.every_versions`, and at the end (the final eval). Finishing stops training dispatch and
cancels the training groups in flight; the runner ends the run once the evals are done.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass

from asyncrl.spec import ExperimentSpec
from asyncrl.types import StepMetrics
from services.scheduler.dispatch import Dispatcher
from services.scheduler.fleet import Fleet, FleetUpdate, fleet_lag
from services.scheduler.lifecycle import Lifecycle, Phase
from services.scheduler.progress import ProgressBook
from services.scheduler.records import CommitResult
from services.scheduler.supervisor import TrainerSupervisor


@dataclass
class RunnerHooks:
    """What the commit handler asks of its experiment runner."""

    enter: Callable[..., None]
    """Enter a phase (`ExperimentRunner._enter`: persisted and told to watchers)."""
    changed: Callable[[], None]
    """Something changed: wake the dispatch loop, persist."""
    spawn: Callable[[Coroutine], object]
    """Run a task the run's end cancels."""
    persist: Callable[[], Awaitable[None]]
    """Write the record now (`ExperimentRunner.persist_now`)."""


class CommitHandler:
    def __init__(
        self,
        spec: ExperimentSpec,
        lifecycle: Lifecycle,
        book: ProgressBook,
        fleet: Fleet,
        dispatcher: Dispatcher,
        supervisor: TrainerSupervisor,
        hooks: RunnerHooks,
        log,
    ):
        self.spec = spec
        self.lifecycle = lifecycle
        self.book = book
        self.record = book.record
        self.fleet = fleet
        self.dispatcher = dispatcher
        self.supervisor = supervisor
        self.hooks = hooks
        self.log = log

    async def commit(
        self,
        version: int,
        uri: str,
        metrics: StepMetrics,
        fingerprint: str = "",
        broadcast_store: str = "",
    ) -> CommitResult:
        """Record `version` (durable in the weight store) as the trainer's newest and answer.
        The caller was authorized first (`TrainerAuthority.authorize`). `broadcast_store`:
        where the trainer's weight group meets now (kept for the fleet's next updates)."""
        t0 = time.perf_counter()
        fleet, over = self.fleet, self.lifecycle.stopping
        fleet.broadcast_store = broadcast_store
        if over:  # late: the run is ending
            if version > fleet.committed_version and self.lifecycle.phase is Phase.ENDING:
                await self._record_late(version, uri, metrics, fingerprint)
            return CommitResult(fleet_version=fleet.version, stop=over)
        if version <= fleet.committed_version:  # a retry: answered as the first call would be
            await self.hooks.persist()  # the first may have failed to store it (NATS away)
            await fleet.reaches(version - fleet_lag(self.spec.rollout), version)
            return CommitResult(fleet_version=fleet.version, stop=self.lifecycle.stopping)
        fleet.commit(version, uri, self.hooks.spawn, fingerprint)
        self.supervisor.committed()
        aborted = self.dispatcher.abort_stale(version)
        if aborted:
            eta = self.spec.rollout.max_head_offpolicyness
            self.log.info("groups_aborted_stale", version=version, aborted=aborted, eta=eta)
        metrics.version = version
        fleet.into_metrics(metrics)
        self.book.add_step(metrics)
        self.log.info(
            "version_committed",
            version=version,
            uri=uri,
            fingerprint=fingerprint,
            fleet_version=fleet.version,
            loss=metrics.loss,
            reward_mean=metrics.reward_mean,
            groups=metrics.groups,
        )
        if version >= self.spec.trainer.total_steps:
            self.begin_finish(f"reached total_steps={self.spec.trainer.total_steps}")
        elif self.dispatcher.dataset_done(fleet.committed_version):
            self.begin_finish("dataset exhausted")
        self.hooks.changed()
        # the step is in the stored record before the trainer hears back and writes it to the
        # ledger: after a power cut the record never counts a step fewer than the ledger
        await self.hooks.persist()
        fleet.commit_took(time.perf_counter() - t0)
        await fleet.reaches(version - fleet_lag(self.spec.rollout), version)
        return CommitResult(fleet_version=fleet.version, stop=self.lifecycle.stopping)

    async def _record_late(
        self, version: int, uri: str, metrics: StepMetrics, fingerprint: str
    ) -> None:
        """A step the trainer finished while the run ends (ENDING: a cancel came while it
        trained; the trainer is being stopped): it is in the trainer's ledger and its final
        checkpoint, so it goes in the record too (the record never counts a step fewer than
        the ledger), but no rollout is updated to it and nothing more is dispatched. Once the
        run is terminal a commit is answered `stop` and nothing else."""
        self.fleet.record_commit(version, uri, fingerprint)
        metrics.version = version
        self.fleet.into_metrics(metrics)
        self.book.add_step(metrics)
        self.log.info("version_committed", version=version, uri=uri, late=True,
                      fingerprint=fingerprint, groups=metrics.groups)  # fmt: skip
        self.hooks.changed()
        await self.hooks.persist()

    def report_dropped(self, group_ids: list[str]) -> int:
        """The trainer dropped accepted groups as too stale: free capacity, re-queue prompts.
        A group id the scheduler did not dispatch and accept for this experiment is a
        BadRequest naming `groups` (nothing is changed, the run goes on)."""
        requeued = self.dispatcher.report_dropped(group_ids)
        if requeued:
            self.log.info(
                "groups_dropped_by_trainer", requeued=requeued, version=self.fleet.version
            )
        self.hooks.changed()
        return requeued

    # ---- evals -------------------------------------------------------------------------------

    def maybe_eval(
        self, version: int, *, start: bool = False, final: bool = False, since: int | None = None
    ) -> None:
        """Evaluate `version` if due (or if one of the versions after `since` the fleet skipped
        was)."""
        if self.dispatcher.evaluator.schedule(version, start=start, final=final, since=since):
            prompts = len(self.dispatcher.eval_prompts)
            self.log.info("eval_started", version=version, prompts=prompts)
            self.hooks.changed()

    def fleet_moved(self, update: FleetUpdate | None) -> None:
        """A rollout became ready, or the fleet serves a new version: evaluate it if due."""
        if update is not None:
            if not self.lifecycle.stopping:
                self.maybe_eval(update.version, since=update.previous)
            elif update.version >= self.fleet.committed_version:
                self.maybe_eval(update.version, final=True)
        self.hooks.changed()

    # ---- the finish --------------------------------------------------------------------------

    def begin_finish(self, reason: str) -> None:
        """Stop training dispatch, cancel training groups in flight (not counted as drops), and
        run the final eval; the dispatch loop completes the experiment once evals are done."""
        if self.lifecycle.stopping:
            return
        self.hooks.enter(Phase.FINISHING, reason=reason)
        fleet = self.fleet
        cancelled = self.dispatcher.cancel(training_only=True)
        self.book.left_over = self.dispatcher.left_over_at_end(self.book.trained_groups)
        self.log.info(
            "experiment_finishing", reason=reason, version=fleet.version, cancelled=cancelled
        )
        if fleet.version >= fleet.committed_version:  # else once the fleet serves the last one
            self.maybe_eval(fleet.version, final=True)
        self.hooks.changed()

    def outcome(self) -> tuple[Phase, str]:
        """COMPLETED with the finish reason, or FAILED when no step was trained, saying what
        happened to the groups (the run's end adds the prompts left over: `left_over_note`)."""
        counts, batch = self.dispatcher.staleness.counts, self.spec.trainer.batch_size
        finish_reason = self.lifecycle.reason  # FINISHING's
        if self.fleet.version > 0 or self.record.history:
            return Phase.COMPLETED, finish_reason
        told = (
            f"{counts.accepted} groups accepted (batch_size={batch}), {counts.rejected}"
            f" filtered, {counts.failed} failed"
        )
        top = sorted(self.record.failure_reasons.items(), key=lambda kv: -kv[1])[:3]
        if top:
            told += " (" + "; ".join(f"{n}x {why}" for why, n in top) + ")"
        return Phase.FAILED, f"trained nothing: {finish_reason}: {told}"


def left_over_note(phase: Phase, message: str, left_over: int) -> str:
    """The final message of a run that ends `phase` with `left_over` prompts left over (the
    figure `status` and the ledger show): said after a completed or cancelled run's reason; a
    failed run's message is its failure (the figure is in its progress)."""
    if left_over and phase is not Phase.FAILED:
        return f"{message}; {left_over} prompts left over, never trained"
    return message
