"""The groups a rollout is running, by id, and the ways one stops before it is published.

A group is aborted by the scheduler (AbortGroups: too stale to train; it answers ABORTED), by
the rollout itself (another experiment bound, or the rollout stopping; it answers FAILED), or
superseded when the scheduler dispatches the same group id again (the earlier call gave up).
An abort stops a group that is generating (its task is cancelled: the engine drops its
requests) or being scored (it stops before publishing); a group being published goes on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.logging import get_logger
from services.rollout.filters import GroupStatus

if TYPE_CHECKING:
    from services.rollout.service import GroupJob

log = get_logger(component="rollout")


@dataclass
class RunningGroup:
    job: GroupJob
    task: asyncio.Task | None = None
    aborted: str = ""  # set when the service itself aborts the group (experiment switch)
    abort_status: GroupStatus = GroupStatus.FAILED
    """What an aborted group answers: ABORTED when the scheduler asked (AbortGroups)."""
    publishing: bool = False
    """Past the last point an abort can stop it: it is (being) published."""


class RunningGroups:
    """The running groups by id: started, finished, aborted, superseded."""

    def __init__(self) -> None:
        self._groups: dict[str, RunningGroup] = {}

    def __len__(self) -> int:
        return len(self._groups)

    async def start(self, job: GroupJob) -> RunningGroup:
        """Register `job`'s group; a run of the same group id still going is superseded."""
        earlier = self._groups.get(job.group_id)
        if earlier is not None:
            await self._supersede(earlier)
        running = RunningGroup(job)
        self._groups[job.group_id] = running
        return running

    def finish(self, running: RunningGroup) -> None:
        """Forget `running` (unless a later run of its group id took its place)."""
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
            if running.task is not None and not running.task.done():
                running.task.cancel()  # generating: the engine drops its requests
            aborted.append(group_id)  # else being scored: it stops before publishing
        if aborted:
            log.info("groups_aborted", groups=len(aborted), reason=reason)
        return aborted

    async def abort_all(self, reason: str) -> int:
        """Abort every group still generating (each answers FAILED with `reason`) and wait for
        them to stop. Returns how many were aborted."""
        tasks = []
        for running in self._groups.values():
            if running.task and not running.task.done():
                running.aborted = reason
                running.task.cancel()
                tasks.append(running.task)
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)

    async def _supersede(self, earlier: RunningGroup) -> None:
        """The scheduler dispatched a group this rollout is still running: it gave the earlier
        call up (this rollout's lease expired while it was cut off, or the reply was lost) and
        re-queued the group under the same id. The earlier run is stale: abort it (its call
        answers FAILED to nobody) and run the group afresh; whatever the earlier run published
        is deduplicated by the id. Refusing instead fenced the whole rollout."""
        earlier.aborted = "aborted: the scheduler dispatched this group again"
        log.info("group_superseded", group=earlier.job.group_id)
        task = earlier.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
