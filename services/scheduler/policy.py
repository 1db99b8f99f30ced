"""The scheduler's pure policy: admission under bounded staleness, stale aborts, assignment.

No grpc/nats here: the experiment runner asks these objects what to do and tells them what
happened. The admission rule is AReaL's:

    capacity = min(max_concurrent - running, (eta + v + 1) * B - (accepted + running))

where `v` is the version the rollout fleet serves. Groups that are dropped for staleness (by
the scheduler's abort or by the trainer) count as rejections so they free capacity; without
that the run deadlocks once drops + running exceed eta * B.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TypeVar

from services.scheduler.records import GroupCounters, field_names

W = TypeVar("W")


class StalenessManager:
    """Counts groups by outcome (`counts`, the only writer) and answers how many more may be
    admitted now.

    `version_provider` returns the fleet version (the weights the rollouts serve).
    """

    def __init__(
        self, max_concurrent: int, batch_size: int, eta: int, version_provider: Callable[[], int]
    ):
        self.max_concurrent = max_concurrent
        self.batch_size = batch_size
        self.eta = eta
        self.version_provider = version_provider
        self.counts = GroupCounters()

    def capacity(self) -> int:
        """Groups that may be dispatched now (never negative)."""
        c = self.counts
        version = self.version_provider()
        concurrency = self.max_concurrent - c.running
        staleness = (self.eta + version + 1) * self.batch_size - (c.accepted + c.running)
        return max(0, min(concurrency, staleness))

    def on_submit(self) -> None:
        self.counts.running += 1
        self.counts.dispatched += 1

    def on_accept(self) -> None:
        self._finish()
        self.counts.accepted += 1

    def on_reject(self) -> None:
        """The dynamic filter dropped the group: it frees its capacity."""
        self._finish()
        self.counts.rejected += 1

    def on_fail(self) -> None:
        self._finish()
        self.counts.failed += 1

    def on_abort(self) -> None:
        """The scheduler aborted an in-flight group that could no longer be trained within eta.

        Counted as a rejection: it frees capacity and never becomes accepted."""
        self._finish()
        self.counts.stale_dropped += 1

    def on_requeue(self) -> None:
        """The group's RPC failed (worker died, deadline, fenced); its prompt goes back."""
        self._finish()
        self.counts.requeued += 1

    def on_cancel(self) -> None:
        """The experiment ended while the group ran; it counts as nothing."""
        self._finish()

    def on_trainer_drop(self) -> None:
        """The trainer dropped an accepted group as too stale: it no longer counts as accepted."""
        self.counts.accepted = max(0, self.counts.accepted - 1)
        self.counts.stale_dropped += 1

    def load_counters(self, saved: GroupCounters) -> None:
        """Restore persisted outcome counters (a Progress is a GroupCounters); `running`
        restarts at 0 (nothing is in flight).

        `accepted` stays what was persisted, whatever version a resumed trainer reports: the
        groups in flight in the same snapshot were not counted yet, and each is counted once
        when its re-dispatch answers (a duplicate publish included). Setting it to
        version * B instead counted the trained ones among them twice."""
        counts = GroupCounters(**{n: int(getattr(saved, n)) for n in field_names(GroupCounters)})
        self.counts = replace(counts, running=0)

    def _finish(self) -> None:
        assert self.counts.running > 0, "a group finished that was never submitted"
        self.counts.running -= 1


def too_stale(start_version: int, committed_version: int, eta: int) -> bool:
    """A group started at `start_version` can no longer be trained by any step after
    `committed_version` is committed (the trainer's next step runs at that version). Unless it
    is already on its way to the trainer (the step that produced `committed_version` may have
    trained it), it can be aborted: the rollout says which it is (AbortGroups)."""
    return committed_version - start_version > eta


def must_abort(start_version: int, committed_version: int, eta: int) -> bool:
    """An in-flight group started at `start_version` can no longer be trained within eta once
    `committed_version` is committed. "In flight" is the scheduler's view: the rollout may have
    published the group already, and the step that produced `committed_version` (trainer at
    `committed_version - 1`) may have trained it; only a group too stale even for that step can
    never have been trained. (Aborting at `committed_version - start > eta` re-queued groups
    that step had trained: make chaos trainer, 4 prompts trained twice.) A group between the
    two the trainer drops itself if it reads it, and reports it."""
    return committed_version - 1 - start_version > eta


def least_loaded(workers: Iterable[W]) -> W | None:
    """The least loaded worker (running / capacity) that has a free slot, ties by id: anything
    with `worker_id`, `running` and `capacity` (a registry Worker), in one pass
    with no copy (once per group)."""
    best, best_key = None, None
    for w in workers:
        capacity = max(1, w.capacity)
        if w.running < capacity:
            key = (w.running / capacity, w.worker_id)
            if best is None or key < best_key:
                best, best_key = w, key
    return best


def divide_slots(total: int, shares: dict[str, float]) -> dict[str, int]:
    """The group slots of a shared fleet (`total`, its rollouts' summed capacity) divided
    between the experiments sharing it by their `share` weights (spec `share`), in the order
    given (oldest first): every experiment gets at least 1 slot, the rest is split in
    proportion by the largest-remainder (Hamilton) method, ties to the earlier experiment.

    An experiment whose proportional part is under 1 slot gets 1 and leaves the others the
    rest, again in proportion; with fewer slots than experiments each still gets 1 (the sum
    then exceeds `total`: the rollouts' capacity, not the quota, holds them back)."""
    fixed = dict.fromkeys(shares, 1) if total <= len(shares) else {}
    while len(fixed) < len(shares):
        rest = {eid: s for eid, s in shares.items() if eid not in fixed}
        left = total - len(fixed)
        weight = sum(rest.values())
        exact = {eid: left * s / weight for eid, s in rest.items()}
        small = [eid for eid, q in exact.items() if q < 1]
        if small:
            fixed |= dict.fromkeys(small, 1)
            continue
        quota = {eid: int(q) for eid, q in exact.items()}
        by_remainder = sorted(rest, key=lambda eid: exact[eid] - quota[eid], reverse=True)
        for eid in by_remainder[: left - sum(quota.values())]:
            quota[eid] += 1
        fixed |= quota
    return {eid: fixed[eid] for eid in shares}
