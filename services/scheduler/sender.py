"""How a dispatch pass's groups reach the rollouts: one GenerateGroups call per rollout for the
groups the pass started, each group settled as its summary comes (by the dispatcher, its
`owner`); groups that ended early are withdrawn (the call cancelled, or AbortGroups)."""

from __future__ import annotations

import asyncio
from typing import Protocol

import grpc

from asyncrl.v1 import rollout_pb2
from services.scheduler.calls import GroupsCall, InFlight, WorkerCalls
from services.scheduler.registry import Worker

FAULT_KEY = "asyncrl-fault"
ABORT_TIMEOUT_S = 5.0
"""Deadline of an AbortGroups call; one that fails changes nothing (the next commit cancels
the groups it named, `must_abort`)."""
WITHDRAWN = "aborted: withdrawn by the scheduler"
_CODES = {code.value[0]: code for code in grpc.StatusCode}
"""grpc.StatusCode by its number (GroupError.code)."""


class Settles(Protocol):
    """What the sender needs of the dispatcher."""

    inflight: dict[str, InFlight]

    def settle(self, item: InFlight) -> bool: ...

    def done(self, item: InFlight, summary: rollout_pb2.GroupSummary) -> None: ...

    def rpc_failed(
        self, item: InFlight, code: grpc.StatusCode, details: str, fault: str = ""
    ) -> None: ...


class GroupSender:
    def __init__(self, calls: WorkerCalls, owner: Settles, log):
        self.calls = calls
        self.owner = owner
        self.log = log
        self._outbox: dict[str, list[tuple[InFlight, rollout_pb2.GenerateGroupRequest]]] = {}
        """Groups dispatched in this pass of the event loop, by rollout: sent at its end."""
        self._aborts: set[asyncio.Task] = set()
        """AbortGroups calls in flight."""

    def queue(self, item: InFlight, request: rollout_pb2.GenerateGroupRequest) -> None:
        """`item` goes out with the rest of this pass's groups for its rollout, in one
        GenerateGroups call (`_send`, at the end of the pass)."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._send)
        self._outbox.setdefault(item.worker.worker_id, []).append((item, request))

    def _send(self) -> None:
        """One GenerateGroups call per rollout for the groups dispatched in this pass (those
        still in flight: one settled meanwhile, its worker fenced say, is not sent)."""
        outbox, self._outbox = self._outbox, {}
        for pending in outbox.values():
            pending = [(i, r) for i, r in pending if self.owner.inflight.get(i.group_id) is i]
            if not pending:
                continue
            call = GroupsCall(pending[0][0].worker, {i.group_id: i for i, _ in pending})
            for item, _ in pending:
                item.call = call
            requests = [r for _, r in pending]
            call.task = asyncio.create_task(self._run(call, requests), name="generate-groups")

    async def _run(
        self, call: GroupsCall, requests: list[rollout_pb2.GenerateGroupRequest]
    ) -> None:
        """Settle each group as its summary comes; the call failing fails the groups it has
        not answered (each as its own failed call would have)."""
        try:
            async for message in self.calls.generate_groups(call.worker, requests):
                for summary in message.summaries:
                    item = call.open.pop(summary.group_id, None)
                    if item is None or not self.owner.settle(item):
                        continue  # withdrawn, or ended by someone else
                    if summary.HasField("error"):
                        error = summary.error
                        code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
                        self.owner.rpc_failed(item, code, error.details, error.fault)
                    else:
                        self.owner.done(item, summary)
        except grpc.aio.AioRpcError as e:
            self._call_failed(call, e.code(), e.details() or "", _fault(e))
            return
        except Exception as e:  # noqa: BLE001 - treated as a failed call, logged with its trace
            self.log.exception("group_call_error", groups=len(call.open))
            self._call_failed(call, grpc.StatusCode.UNKNOWN, str(e))
            return
        if call.open:  # the stream ended without their summaries
            self._call_failed(call, grpc.StatusCode.UNKNOWN, "the call ended without a summary")

    def _call_failed(
        self, call: GroupsCall, code: grpc.StatusCode, details: str, fault: str = ""
    ) -> None:
        items, call.open = list(call.open.values()), {}
        for item in items:
            if self.owner.settle(item):
                self.owner.rpc_failed(item, code, details, fault)

    def withdraw(self, items: list[InFlight]) -> None:
        """Stop the rollouts working on these settled groups: the rollout is asked to abort
        them (AbortGroups, in the background; one already being published goes on, whatever
        it becomes is no longer counted), and a call left with none of its groups is
        cancelled. (A call that ends without AbortGroups leaves its groups going for a while,
        for a successor scheduler to adopt: `services.rollout.running`.)"""
        withdrawn: dict[int, tuple[GroupsCall, list[str]]] = {}
        for item in items:
            call = item.call
            if call is None or call.open.pop(item.group_id, None) is None:
                continue  # not sent yet (`_send` skips it), or answered
            withdrawn.setdefault(id(call), (call, []))[1].append(item.group_id)
        by_worker: dict[str, tuple[Worker, list[str]]] = {}
        for call, group_ids in withdrawn.values():
            if not call.open:
                call.task.cancel()
            by_worker.setdefault(call.worker.worker_id, (call.worker, []))[1].extend(group_ids)
        for worker, group_ids in by_worker.values():
            self.abort(worker, group_ids, WITHDRAWN)

    def abort(self, worker: Worker, group_ids: list[str], reason: str) -> None:
        """AbortGroups for these groups of `worker`, in the background (its answer is logged;
        an aborted group's summary comes on its GenerateGroups call, ABORTED)."""
        task = asyncio.create_task(self._abort_unpublished(worker, group_ids, reason))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort_unpublished(self, worker: Worker, group_ids: list[str], reason: str) -> None:
        try:
            aborted = await self.calls.abort_groups(worker, group_ids, reason, ABORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            self.log.info(
                "abort_groups_failed",
                worker=worker.worker_id,
                groups=len(group_ids),
                code=e.code().name,
            )
            return
        self.log.info(
            "groups_abort_requested",
            worker=worker.worker_id,
            requested=len(group_ids),
            aborted=len(aborted),
            reason=reason,
        )

    def stop(self) -> list[asyncio.Task]:
        """The scheduler is stopping: the tasks to cancel (calls, AbortGroups). Groups of this
        pass not sent yet are not sent (they stay in flight in the saved record)."""
        self._outbox.clear()
        calls = {id(i.call): i.call.task for i in self.owner.inflight.values() if i.call}
        return [*calls.values(), *self._aborts]


def _fault(error: grpc.aio.AioRpcError) -> str:
    """The `asyncrl-fault` trailing metadata a rollout sets when it is fine but a service it
    needs was unreachable (rollout.proto, GenerateGroup); "" for any other failure."""
    return dict(error.trailing_metadata() or ()).get(FAULT_KEY, "")
