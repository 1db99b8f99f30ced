"""The groups a rollout is running, by id, and the ways one stops before it is published.

A group is aborted by the scheduler (AbortGroups: too stale to train, or withdrawn; it answers
ABORTED), by the rollout itself (another experiment bound, or the rollout stopping; it answers
FAILED), or superseded when the scheduler dispatches the same group id for another prompt. An
abort stops a group that is generating (its task is cancelled: the engine drops its requests)
or being scored (it stops before publishing); a group being published goes on.

A group outlives its call. When the call that dispatched it ends without its summary (the
scheduler closed for a hand-over or a restart, or lost the connection) and nobody aborted the
group, it is an *orphan*: it goes on generating and scoring for ORPHAN_GRACE_S but publishes
nothing. A call for the same group id and prompt within that time (the scheduler's successor
dispatches the groups it finds in flight under their own ids) adopts it and gets its summary;
otherwise it is cancelled. So a scheduler hand-over costs the run no generation.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from asyncrl.logging import get_logger
from services.rollout.filters import GroupStatus

if TYPE_CHECKING:
    from services.rollout.service import GroupJob, GroupSummary

log = get_logger(component="rollout")

ORPHAN_GRACE_S = 30.0
"""How long a group whose call ended goes on without one, waiting to be adopted: a scheduler's
successor dispatches the groups in flight within seconds of its start."""


@dataclass
class RunningGroup:
    job: GroupJob
    task: asyncio.Task | None = None
    """Its trajectories being generated (`RolloutService._samples`)."""
    work: asyncio.Task | None = None
    """The whole group, generation to summary (`RolloutService._run_group`); calls await it."""
    aborted: str = ""  # set when the service itself aborts the group (experiment switch)
    abort_status: GroupStatus = GroupStatus.FAILED
    """What an aborted group answers: ABORTED when the scheduler asked (AbortGroups)."""
    publishing: bool = False
    """Past the last point an abort can stop it: it is (being) published."""
    callers: int = 0
    attended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while a call waits for the summary: only then is the group published."""
    orphan_timer: asyncio.TimerHandle | None = None

    def same_group(self, job: GroupJob) -> bool:
        """`job` asks for this group again (all but the reward addresses the same), not another."""
        return replace(self.job, reward_addresses=job.reward_addresses) == job

    async def until_attended(self) -> None:
        """Wait for a call to take the summary (at once while one waits): an orphan's is
        published only once a call adopts it."""
        if not self.attended.is_set():
            log.info("group_orphan_done", group=self.job.group_id)
            await self.attended.wait()


class RunningGroups:
    """The running groups by id: started, attended, orphaned, adopted, aborted, superseded."""

    def __init__(self) -> None:
        self._groups: dict[str, RunningGroup] = {}

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def orphans(self) -> int:
        return sum(1 for g in self._groups.values() if not g.callers)

    def adopt(self, job: GroupJob) -> RunningGroup | None:
        """The run of `job`'s group already going (an orphan, or one whose earlier call is
        still open), to wait for instead of generating it again; None if there is none."""
        running = self._groups.get(job.group_id)
        if running is None or running.aborted or running.work.done():
            return None
        if not running.same_group(job):
            return None
        if not running.callers:
            log.info("group_adopted", group=job.group_id)
        return running

    async def start(self, job: GroupJob) -> RunningGroup:
        """Register `job`'s group; a run of the same group id for another prompt is
        superseded."""
        earlier = self._groups.get(job.group_id)
        if earlier is not None:
            await self._supersede(earlier)
        running = RunningGroup(job)
        self._groups[job.group_id] = running
        return running

    async def attend(self, running: RunningGroup) -> GroupSummary:
        """Wait for `running`'s summary as one of its callers. A caller that leaves first
        (cancelled) leaves the group going, an orphan when it was the last (or stops it, when
        it was aborted)."""
        running.callers += 1
        running.attended.set()
        if running.orphan_timer is not None:
            running.orphan_timer.cancel()
            running.orphan_timer = None
        try:
            return await asyncio.shield(running.work)
        finally:
            running.callers -= 1
            if running.work.done():
                self.finish(running)
            elif not running.callers:
                self._orphan(running)

    def finish(self, running: RunningGroup) -> None:
        """Forget `running` (unless a later run of its group id took its place)."""
        if running.orphan_timer is not None:
            running.orphan_timer.cancel()
        if self._groups.get(running.job.group_id) is running:
            del self._groups[running.job.group_id]

    def abort_unpublished(
        self, group_ids: list[str], reason: str, experiment_id: str | None = None
    ) -> list[str]:
        """Abort the named groups (of `experiment_id` only, when given: never another
        experiment's) that have not begun publishing (AbortGroups); each answers ABORTED with
        `reason`. Returns the ids aborted; the others go on as they would."""
        aborted = []
        for group_id in group_ids:
            running = self._groups.get(group_id)
            if running is None or running.publishing or running.aborted:
                continue
            if experiment_id is not None and running.job.experiment_id != experiment_id:
                continue
            running.aborted, running.abort_status = reason, GroupStatus.ABORTED
            if not running.callers:  # an orphan: nobody waits for its answer
                running.work.cancel()
            elif running.task is not None and not running.task.done():
                running.task.cancel()  # generating: the engine drops its requests
            aborted.append(group_id)  # else being scored: it stops before publishing
        if aborted:
            log.info("groups_aborted", groups=len(aborted), reason=reason)
        return aborted

    async def abort_all(self, reason: str) -> int:
        """Abort every group still generating (each answers FAILED with `reason`) and every
        orphan, and wait for them to stop. Returns how many were aborted."""
        tasks = []
        for running in self._groups.values():
            if not running.callers and running.work is not None and not running.work.done():
                running.aborted = reason
                running.work.cancel()
                tasks.append(running.work)
            elif running.task and not running.task.done():
                running.aborted = reason
                running.task.cancel()
                tasks.append(running.task)
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)

    def _orphan(self, running: RunningGroup) -> None:
        running.attended.clear()
        if running.aborted:  # the scheduler (or this rollout) stopped it: nothing to keep
            running.work.cancel()
            return
        log.info("group_orphaned", group=running.job.group_id, grace_s=ORPHAN_GRACE_S)
        loop = asyncio.get_running_loop()
        running.orphan_timer = loop.call_later(ORPHAN_GRACE_S, self._drop_orphan, running)

    def _drop_orphan(self, running: RunningGroup) -> None:
        running.orphan_timer = None
        if not running.callers and not running.work.done():
            log.info("group_orphan_dropped", group=running.job.group_id, grace_s=ORPHAN_GRACE_S)
            running.aborted = "aborted: no call adopted it"
            running.work.cancel()

    async def _supersede(self, earlier: RunningGroup) -> None:
        """The scheduler dispatched a group id this rollout is still running, for another
        prompt (or the earlier run was aborted): the earlier run is stale: abort it (its call
        answers FAILED to nobody) and run the group afresh; whatever the earlier run published
        is deduplicated by the id. Refusing instead fenced the whole rollout."""
        earlier.aborted = "aborted: the scheduler dispatched this group again"
        log.info("group_superseded", group=earlier.job.group_id)
        stop = earlier.task if earlier.callers else earlier.work  # an orphan answers nobody
        if stop is not None and not stop.done():
            stop.cancel()
            await asyncio.wait([stop])
