"""Admission and accounting of one experiment's groups: what to dispatch next and where, and
what each outcome means for the staleness budget, the dataset cursor and the eval rounds.

Every group in flight is an `InFlight` whose accounting happens exactly once, in `settle`, by
whoever ends it first: its own RPC returning, a stale abort, a fenced or expired worker, or the
end of the run. Cancelling a call makes the rollout abort the generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from asyncrl.errors import BadRequest
from asyncrl.ledger import Ledger
from asyncrl.spec import ExperimentSpec
from asyncrl.throughput import Throughput
from asyncrl.ticket import Ticket
from asyncrl.types import EvalResult, GroupId
from asyncrl.v1 import rollout_pb2
from services.scheduler.calls import InFlight, WorkerCalls
from services.scheduler.dataset import DatasetCursor, Prompt
from services.scheduler.evaluation import EvalRound, Evaluator
from services.scheduler.policy import (
    StalenessManager,
    least_loaded,
    must_abort,
    too_stale,
)
from services.scheduler.records import ExperimentRecord
from services.scheduler.registry import Registry, Worker
from services.scheduler.sender import GroupSender

THROUGHPUT_WINDOW_S = 30.0
STALE = "aborted: too stale"


@dataclass
class DispatchHooks:
    """What the dispatcher tells its experiment runner."""

    changed: Callable[[], None]
    """Something was dispatched or settled: wake the loop, persist."""
    fence: Callable[[Worker, str], None]
    """A worker's call failed: unbind it (its other groups come back through `requeue`)."""
    eval_done: Callable[[EvalResult], None]
    """An eval round's result (the group that completed it was settled: `changed` ran)."""
    freed: Callable[[Worker], None] = lambda worker: None
    """A group on a shared rollout ended: its slot may go to another experiment."""


_STATUS_NAMES = {
    rollout_pb2.GROUP_STATUS_ACCEPTED: "accepted",
    rollout_pb2.GROUP_STATUS_REJECTED: "rejected",
    rollout_pb2.GROUP_STATUS_FAILED: "failed",
}


class Dispatcher:
    def __init__(
        self,
        record: ExperimentRecord,
        spec: ExperimentSpec,
        prompts: list[Prompt],
        eval_prompts: list[Prompt],
        calls: WorkerCalls,
        registry: Registry,
        hooks: DispatchHooks,
        log,
        version: Callable[[], int],
        ledger: Ledger,
    ):
        self.record = record
        self.ledger = ledger
        """Where every training group's fate is recorded (asyncrl.ledger)."""
        self._left_over: set[tuple[int, int]] = set()
        """The prompts (epoch, index) this run wrote to the ledger as left over (`cancel`),
        each once, as the ledger counts them: a run cancels twice (as it begins finishing and
        as it ends), and a prompt re-queued then is still waiting the second time."""
        self.spec = spec
        self.prompts = prompts
        self.eval_prompts = eval_prompts
        self.calls = calls
        self.registry = registry
        """Through which a rollout's group counts change."""
        self.hooks = hooks
        self.log = log
        self.version = version
        self.eta = spec.rollout.max_head_offpolicyness
        self.staleness = StalenessManager(
            spec.rollout.max_concurrent_rollouts, spec.trainer.batch_size, self.eta, version
        )
        self.evaluator = Evaluator(
            len(eval_prompts),
            spec.eval.every_versions,
            spec.eval.n_samples,
            {e.version for e in record.evals},
        )
        self.inflight: dict[str, InFlight] = {}
        self.slots: int | None = None
        """Groups this experiment may have in flight on a shared fleet (its part of the shared
        rollouts' slots, `policy.divide_slots`, set by the scheduler's binding); None: the
        rollouts are its alone."""
        self._aborted: set[str] = set()
        """Training groups the scheduler ended itself (aborted as too stale, cancelled at the
        end of the run): a drop report for one changes nothing."""
        self._drops_seen: set[str] = set()
        self.sender = GroupSender(calls, self, log)
        self.throughput = Throughput(THROUGHPUT_WINDOW_S)
        """Tokens the fleet generated for this experiment."""
        self._resume(record)

    def _resume(self, record: ExperimentRecord) -> None:
        """Counters, cursor and awaiting groups as the record saved them. Groups in flight when
        it was saved go first with the same attempt: if the lost call had published, JetStream
        dedup drops the duplicate. The persisted counters come from the same snapshot, so none
        of these was counted yet."""
        self.staleness.load_counters(record.progress)
        ds = self.spec.dataset
        self.cursor = DatasetCursor(
            len(self.prompts), ds.epochs, ds.shuffle, self.spec.seed, record.cursor or None
        )
        for ticket in reversed(record.inflight):
            self.cursor.requeue(ticket, front=True)
        self.awaiting: dict[str, Ticket] = {t.group_id(record.id): t for t in record.awaiting}
        """Accepted training groups the trainer may still report dropped, oldest first: the
        newest `awaiting_max`."""
        self.cancelled: list[Ticket] = list(record.cancelled)
        """Training groups cancelled in flight as the run ended: a resume sends them again."""

    def save_into(self, record: ExperimentRecord) -> None:
        """What a resume needs: the cursor and the tickets in flight, awaiting and cancelled."""
        record.cursor = self.cursor.state()
        record.inflight = [i.ticket for i in self.inflight.values() if i.ticket]
        record.awaiting = list(self.awaiting.values())
        record.cancelled = list(self.cancelled)

    @property
    def awaiting_max(self) -> int:
        """Eight times the most groups that can be accepted and not yet trained ((eta + 1) * B)
        plus those that may settle out of order (max_concurrent_rollouts). Twice was too few:
        with drops and re-dispatches the trainer read groups 374 acceptances back (bench
        control_plane, B=32, eta=1, window 256), its ReportDropped was refused and it failed."""
        spec = self.spec
        return 8 * ((self.eta + 1) * spec.trainer.batch_size + spec.rollout.max_concurrent_rollouts)

    def dataset_done(self, trained_version: int) -> bool:
        """No prompt left, none in flight, and fewer untrained accepted groups than a batch
        (the trainer committed `trained_version`, so it trained that many batches)."""
        batch = self.spec.trainer.batch_size
        counts = self.staleness.counts
        untrained = counts.accepted - trained_version * batch
        return self.cursor.exhausted and counts.running == 0 and untrained < batch

    # ---- dispatch ----------------------------------------------------------------------------

    def dispatch_one(
        self, rollouts: list[Worker], reward_addresses: list[str], training: bool
    ) -> bool:
        """Start one group (eval first) on the least loaded of `rollouts` (those serving the
        fleet version) if one has a free slot and the rules allow it."""
        if self.slots is not None and len(self.inflight) >= self.slots:
            return False  # its part of a shared fleet is in use
        worker = least_loaded(rollouts)
        if not reward_addresses or worker is None:
            return False
        version = self.version()
        if self.evaluator.running < self.spec.rollout.max_concurrent_rollouts:
            nxt = self.evaluator.next()
            if nxt is not None:
                eval_round, index, attempt = nxt
                prompt = self.eval_prompts[index]
                group_id = self.calls.eval_group_id(eval_round, prompt, attempt)
                request = self.calls.group_request(group_id, prompt, reward_addresses, eval=True)
                self.evaluator.running += 1
                self._start(
                    InFlight(
                        request.group_id,
                        worker,
                        version,
                        eval_round=eval_round,
                        eval_index=index,
                        eval_attempt=attempt,
                    ),
                    request,
                )
                return True
        if not training or self.staleness.capacity() <= 0:
            return False
        ticket = self.cursor.next()
        if ticket is None:
            return False
        request = self.calls.group_request(
            self.calls.train_group_id(ticket),
            self.prompts[ticket.index],
            reward_addresses,
            eval=False,
            epoch=ticket.epoch,
        )
        self.staleness.on_submit()
        self._start(InFlight(request.group_id, worker, version, ticket=ticket), request)
        self.ledger.emit(
            "dispatched",
            group=request.group_id,
            prompt=request.prompt_id,
            epoch=ticket.epoch,
            index=ticket.index,
            attempt=ticket.attempt,
            worker=worker.worker_id,
            version=version,
        )
        return True

    def _start(self, item: InFlight, request: rollout_pb2.GenerateGroupRequest) -> None:
        """Count `item` in flight now; it goes out with the rest of this pass's groups for its
        rollout, in one GenerateGroups call (`GroupSender`)."""
        assert item.group_id not in self.inflight, f"group {item.group_id} dispatched twice"
        self.registry.group_started(item.worker)
        self.inflight[item.group_id] = item
        self.sender.queue(item, request)
        self.hooks.changed()

    def settle(self, item: InFlight) -> bool:
        """End `item` once: False if someone else (abort, fence, finish) already did."""
        if self.inflight.get(item.group_id) is not item:
            return False
        del self.inflight[item.group_id]
        self.registry.group_ended(item.worker)
        if item.eval_round is not None:
            self.evaluator.running -= 1
        self.hooks.changed()
        if len(item.worker.shared) > 1:
            self.hooks.freed(item.worker)
        return True

    # ---- outcomes ----------------------------------------------------------------------------

    def done(self, item: InFlight, summary: rollout_pb2.GroupSummary) -> None:
        """`item`'s summary came (it was settled first): count its outcome."""
        self.registry.group_done(item.worker)
        self.throughput.add(summary.tokens)
        if summary.status == rollout_pb2.GROUP_STATUS_ABORTED and item.ticket is not None:
            self._stale(item)  # AbortGroups stopped it before anything was published
            return
        if item.ticket is not None:
            self.ledger.emit(
                "settled",
                group=item.group_id,
                status=_STATUS_NAMES.get(summary.status, "failed"),
                reason=summary.reason,
                duplicate=summary.duplicate,
            )
        if item.eval_round is not None:
            item.eval_round.add(
                list(summary.rewards),
                summary.failed_samples,
                summary.status == rollout_pb2.GROUP_STATUS_FAILED,
                (summary.start_version, summary.end_version) if summary.tokens else None,
            )
            self._eval_progress(item.eval_round)
        elif summary.status == rollout_pb2.GROUP_STATUS_ACCEPTED:
            # A duplicate is a retry of a call that published and whose answer never came (a
            # lost reply, a scheduler restart): that call was never counted, this one is.
            if summary.duplicate:
                self.log.info("group_duplicate", group=item.group_id, worker=item.worker.worker_id)
            self.staleness.on_accept()
            self.awaiting[item.group_id] = item.ticket
            while len(self.awaiting) > self.awaiting_max:
                del self.awaiting[next(iter(self.awaiting))]
        elif summary.status == rollout_pb2.GROUP_STATUS_REJECTED:
            self.staleness.on_reject()
        else:
            self.staleness.on_fail()
            reason = summary.reason or "unspecified"
            self.record.failure_reasons[reason] = self.record.failure_reasons.get(reason, 0) + 1
            self.log.warning(
                "group_failed", group=item.group_id, worker=item.worker.worker_id, reason=reason
            )

    def rpc_failed(
        self, item: InFlight, code: grpc.StatusCode, details: str, fault: str = ""
    ) -> None:
        """The call failed (worker died, deadline, error): re-queue the prompt under the same
        id, and fence the worker unless the group merely ran past its deadline or the worker
        answered that a service it needs (`fault`, e.g. the reward) was unreachable."""
        self.log.warning(
            "group_rpc_failed",
            group=item.group_id,
            worker=item.worker.worker_id,
            code=code.name,
            details=details,
            fault=fault,
        )
        self._requeue(item, f"GenerateGroup failed: {code.name}{f' ({fault})' if fault else ''}")
        if code != grpc.StatusCode.DEADLINE_EXCEEDED and not fault:
            self.hooks.fence(item.worker, f"GenerateGroup failed: {code.name}")

    def _requeue(self, item: InFlight, reason: str) -> None:
        """An infrastructure fault: the prompt goes back under the same group id."""
        if item.ticket is not None:
            self.staleness.on_requeue()
            self.cursor.requeue(item.ticket)
            self.ledger.emit("retried", group=item.group_id, reason=reason)
        else:
            item.eval_round.retry(item.eval_index, item.eval_attempt)
            self._eval_progress(item.eval_round)

    def _eval_progress(self, eval_round: EvalRound) -> None:
        result = self.evaluator.pop_finished(eval_round)
        if result is not None:
            self.hooks.eval_done(result)

    def _end(self, pred: Callable[[InFlight], bool], how: str) -> int:
        """Settle the matching groups and withdraw them from their rollouts.
        how: requeue (worker gone) | abort (too stale) | cancel (the run is over)."""
        return self._end_items([i for i in self.inflight.values() if pred(i)], how)

    def _end_items(self, items: list[InFlight], how: str) -> int:
        """`_end` of these groups in flight."""
        for item in items:
            self.settle(item)
            if item.group_id in self._drops_seen:
                pass  # the trainer reported it dropped: its prompt is re-queued already
            elif how == "requeue":
                self._requeue(item, "its rollout was lost or fenced")
            elif how == "abort":
                self._stale(item)
            elif item.ticket is not None:
                self.staleness.on_cancel()
                self._aborted.add(item.group_id)
                self.cancelled.append(item.ticket)
        self.sender.withdraw(items)
        cancelled = [i for i in items if how == "cancel" and i.ticket is not None]
        if cancelled:
            groups = [i.group_id for i in cancelled]
            self.ledger.emit("left_over", groups=groups, reason="in flight when the run ended")
            self._left_over.update((i.ticket.epoch, i.ticket.index) for i in cancelled)
        return len(items)

    def _stale(self, item: InFlight) -> None:
        """A training group ended as too stale without being published: its prompt is
        re-queued as a new attempt."""
        self.staleness.on_abort()
        self.cursor.requeue(item.ticket, new_attempt=True)
        self._aborted.add(item.group_id)
        self.ledger.emit("dropped", group=item.group_id, reason=STALE)

    def requeue_worker(self, worker: Worker) -> int:
        """`worker` is gone or fenced: its groups count as failed calls, prompts re-queued."""
        return self._end(lambda i: i.worker is worker, "requeue")

    def abort_stale(self, new_version: int) -> int:
        """Training groups that can no longer be trained within eta at `new_version`: cancel
        those that even the step that produced it could not have trained (`must_abort`), and
        ask the rollouts to abort the others unless they are already being published
        (`too_stale`; AbortGroups, in the background): those answer ABORTED and are re-queued
        then (`done`), a published one the trainer trains or drops. Returns the cancelled."""
        ended: list[InFlight] = []
        stale: list[InFlight] = []
        for item in self.inflight.values():  # one pass, every commit
            if item.ticket is None:
                continue
            if must_abort(item.start_version, new_version, self.eta):
                ended.append(item)
            elif not item.abort_sent and too_stale(item.start_version, new_version, self.eta):
                stale.append(item)
        self._end_items(ended, "abort")
        by_worker: dict[str, tuple[Worker, list[str]]] = {}
        for item in stale:
            item.abort_sent = True
            by_worker.setdefault(item.worker.worker_id, (item.worker, []))[1].append(item.group_id)
        for worker, group_ids in by_worker.values():
            self.sender.abort(worker, group_ids, STALE)
        return len(ended)

    def cancel(self, training_only: bool) -> int:
        """The run is over: cancel groups in flight; not counted as drops, not re-queued.
        Prompts re-queued and not dispatched again are left over too."""
        waiting = {(t.epoch, t.index) for t in self.cursor.requeued} - self._left_over
        if waiting:
            prompts = [list(key) for key in sorted(waiting)]
            self.ledger.emit("left_over", prompts=prompts, reason="re-queued when the run ended")
            self._left_over |= waiting
        return self._end(lambda i: i.ticket is not None or not training_only, "cancel")

    def left_over_at_end(self, trained_groups: int) -> int:
        """The prompts left over as the run finishes: what `cancel` wrote as left over, and the
        accepted groups never trained (the trainer writes those as it stops). At the end the
        ledger's own count replaces it (`experiments.close_ledger`), this estimate only when
        the ledger cannot be read."""
        return len(self._left_over) + max(0, self.staleness.counts.accepted - trained_groups)

    def report_dropped(self, group_ids: list[str]) -> int:
        """The trainer dropped accepted groups as too stale: free capacity, re-queue prompts.

        Only groups this experiment dispatched and may still see trained count: accepted ones,
        and ones in flight or waiting to be dispatched again (the trainer may read a group
        whose answer is still on its way, or was lost); one reported twice, or ended by the
        scheduler already, is ignored, as is one whose prompt the cursor has passed (a
        re-report after a restart). Any other id is a BadRequest naming `groups`, and nothing
        is changed."""
        tickets = {}
        for group_id in dict.fromkeys(group_ids):
            if group_id in self._drops_seen or group_id in self._aborted:
                continue  # reported twice, or already re-queued when the scheduler aborted it
            ticket = self._droppable(group_id)
            if ticket is None and self._passed(group_id):
                continue  # re-reported after a restart forgot _drops_seen: handled then
            if ticket is None:
                raise BadRequest(
                    "groups",
                    f"{group_id!r} is no training group of {self.record.id} that was"
                    " accepted or is in flight",
                )
            tickets[group_id] = ticket
        for group_id, ticket in tickets.items():
            self._drops_seen.add(group_id)
            self.awaiting.pop(group_id, None)
            self.staleness.on_trainer_drop()
            self.ledger.emit("dropped", group=group_id, reason="the trainer found it too stale")
            self.cursor.requeue(ticket, new_attempt=True)
        return len(tickets)

    def _passed(self, group_id: str) -> bool:
        """Whether `group_id` is a training group of this experiment whose prompt the cursor
        has passed (dispatched, so any drop of it was handled: derived, not remembered)."""
        gid = GroupId.parse(group_id)
        c = self.cursor
        if gid is None or gid.experiment_id != self.record.id or gid.index >= c.n_prompts:
            return False
        if gid.epoch != c.epoch:
            return gid.epoch < c.epoch
        return c.order(c.epoch).index(gid.index) < c.position

    def _droppable(self, group_id: str) -> Ticket | None:
        """The ticket of a training group the trainer may report dropped, else None."""
        if group_id in self.awaiting:
            return self.awaiting[group_id]
        item = self.inflight.get(group_id)
        if item is not None:
            return item.ticket
        experiment_id = self.record.id
        return next(
            (t for t in self.cursor.requeued if t.group_id(experiment_id) == group_id), None
        )

    def stop(self) -> list[asyncio.Task]:
        """The scheduler is stopping: the tasks to cancel (calls, AbortGroups)."""
        return self.sender.stop()
