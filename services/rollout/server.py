"""Rollout gRPC server: a thin servicer over RolloutService, plus proto <-> domain conversion.

`create_rollout` connects to NATS (ensuring the trajectory stream), starts the engine, serves
Rollout + health + reflection, and registers with the scheduler as a rollout worker, all on
one `ServiceRuntime`; `await runtime.close()` stops it gracefully.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from asyncrl.announcements import WeightsFollower
from asyncrl.errors import status_message
from asyncrl.logging import get_logger
from asyncrl.metrics import gauge
from asyncrl.natsutil import ensure_stream
from asyncrl.runtime import ServiceRuntime, error_status
from asyncrl.supervisor.handover import RecentWork
from asyncrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.rollout.engine import Engine
from services.rollout.filters import GroupStatus
from services.rollout.reward_client import RewardUnavailable
from services.rollout.service import GroupJob, GroupSummary, RolloutService

log = get_logger()

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
DEFAULT_CAPACITY = 64
FAULT = ("asyncrl-fault", "reward-unavailable")
"""Trailing metadata of an UNAVAILABLE GenerateGroup whose reward services were unreachable
(see GenerateGroup in rollout.proto)."""

_STATUS = {
    GroupStatus.ACCEPTED: rollout_pb2.GROUP_STATUS_ACCEPTED,
    GroupStatus.REJECTED: rollout_pb2.GROUP_STATUS_REJECTED,
    GroupStatus.FAILED: rollout_pb2.GROUP_STATUS_FAILED,
    GroupStatus.ABORTED: rollout_pb2.GROUP_STATUS_ABORTED,
}


class GroupCallError(Exception):
    """A group of GenerateGroups failed where its own GenerateGroup call would have failed with
    `code`, `details` and the `fault` marker: it is answered as the summary's `error`, and the
    call goes on for the other groups."""

    def __init__(self, code: grpc.StatusCode, details: str, fault: str = ""):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.fault = code, details, fault


GENERATE_GROUPS = f"/{SERVICE_NAME}/GenerateGroups"


async def answer_groups(
    request: rollout_pb2.GenerateGroupsRequest,
    one: Callable[[rollout_pb2.GenerateGroupRequest], Awaitable[rollout_pb2.GroupSummary]],
) -> AsyncIterator[rollout_pb2.GroupSummaries]:
    """GenerateGroups in terms of one group's coroutine: all of them at once, each summary
    sent as it is ready (what finished in the same pass of the event loop goes in one
    message). A group that raises is answered with `error` (GroupCallError's fields, or the
    status its exception maps to); leaving early (the call was cancelled or failed) cancels
    the groups still running."""
    ready: asyncio.Queue[rollout_pb2.GroupSummary] = asyncio.Queue()

    async def run(group: rollout_pb2.GenerateGroupRequest) -> None:
        try:
            summary = await one(group)
        except GroupCallError as e:
            summary = _failed(group.group_id, e.code, e.details, e.fault)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the call is over: nobody waits for this answer
            # cancelled from inside (not by the call): answered, or the call would never end
            summary = _failed(group.group_id, grpc.StatusCode.CANCELLED, "group cancelled")
        except Exception as e:  # noqa: BLE001 - this group's failure, as its own call would have
            summary = _failed(group.group_id, *error_status(GENERATE_GROUPS, e))
        ready.put_nowait(summary)

    tasks = [asyncio.create_task(run(group)) for group in request.groups]
    try:
        left = len(tasks)
        while left:
            batch = [await ready.get()]
            while not ready.empty():
                batch.append(ready.get_nowait())
            left -= len(batch)
            yield rollout_pb2.GroupSummaries(summaries=batch)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _failed(
    group_id: str, code: grpc.StatusCode, details: str, fault: str = ""
) -> rollout_pb2.GroupSummary:
    error = rollout_pb2.GroupError(code=code.value[0], details=details, fault=fault)
    return rollout_pb2.GroupSummary(group_id=group_id, error=error)


def job_from_proto(req: rollout_pb2.GenerateGroupRequest) -> GroupJob:
    return GroupJob(
        experiment_id=req.experiment_id,
        group_id=req.group_id,
        prompt_id=req.prompt_id,
        prompt=req.prompt,
        answer=req.answer,
        reward_addresses=list(req.reward_addresses),
        eval=req.eval,
        epoch=req.epoch,
    )


def summary_to_proto(s: GroupSummary) -> rollout_pb2.GroupSummary:
    return rollout_pb2.GroupSummary(
        group_id=s.group_id,
        status=_STATUS[s.status],
        reason=s.reason,
        rewards=s.rewards,
        failed_samples=s.failed_samples,
        tokens=s.tokens,
        start_version=s.start_version,
        end_version=s.end_version,
        published=s.published,
        duplicate=s.duplicate,
        duration_s=s.duration_s,
        worker=s.worker,
    )


class GroupsServicer(rollout_pb2_grpc.RolloutServicer):
    """GenerateGroup and GenerateGroups over one group's coroutine, `_group` (which raises
    GroupCallError to fail its group as its own call would fail)."""

    async def _group(self, request: rollout_pb2.GenerateGroupRequest) -> rollout_pb2.GroupSummary:
        raise NotImplementedError

    async def GenerateGroup(self, request, context):
        try:
            return await self._group(request)
        except GroupCallError as e:
            trailing = ((FAULT[0], e.fault),) if e.fault else None
            await context.abort(e.code, status_message(e.details), trailing_metadata=trailing)

    async def GenerateGroups(self, request, context):
        async for summaries in answer_groups(request, self._group):
            yield summaries


class RolloutServicer(GroupsServicer):
    def __init__(self, service: RolloutService):
        self.service = service
        self.follower: WeightsFollower | None = None
        """Follows the bound experiments' weight announcements (asyncrl.announcements)."""

    def follow(self, agent) -> None:
        """Follow announcements as the worker `agent` registers (before it registers)."""
        self.follower = WeightsFollower(agent, self.UpdateWeights)

    async def BindExperiment(self, request, context):
        await self.service.bind(request.experiment_id, request.spec_json)
        if self.follower is not None:  # its weight announcements from now on (NATS)
            await self.follower.follow(request.experiment_id)
        return common_pb2.BindExperimentResponse()

    async def _group(self, request: rollout_pb2.GenerateGroupRequest) -> rollout_pb2.GroupSummary:
        try:
            summary = await self.service.generate_group(job_from_proto(request))
        except RewardUnavailable as e:
            # not the group's fate: the scheduler re-queues it under the same id, and the
            # marker tells it this worker is fine (no fence)
            raise GroupCallError(grpc.StatusCode.UNAVAILABLE, str(e), FAULT[1]) from None
        return summary_to_proto(summary)

    async def AbortGroups(self, request, context):
        aborted = self.service.abort_unpublished(
            request.experiment_id, list(request.group_ids), request.reason or "aborted"
        )
        return rollout_pb2.AbortGroupsResponse(aborted=aborted)

    async def UpdateWeights(self, request, context):
        r = await self.service.update_weights(
            request.experiment_id,
            request.version,
            request.uri,
            request.fingerprint,
            (request.group_rank, request.group_size),
            request.broadcast_store,
        )
        return rollout_pb2.UpdateWeightsResponse(
            version=r.version,
            seconds=r.seconds,
            interrupted=r.interrupted,
            read_s=r.phases.read_s,
            pause_s=r.phases.pause_s,
            load_s=r.phases.load_s,
            resume_s=r.phases.resume_s,
            fingerprint=r.fingerprint,
        )

    async def GetStatus(self, request, context):
        s = self.service.status()
        return rollout_pb2.RolloutStatus(
            worker_id=s.worker_id,
            experiment_id=s.experiment_id,
            version=s.version,
            running_groups=s.running_groups,
            running_samples=s.running_samples,
            tokens_generated=s.tokens_generated,
            tokens_per_s=s.tokens_per_s,
            engine=s.engine,
        )


class RolloutCollector(Collector):
    """Running and orphaned groups, running samples, tokens generated, the version the engine
    serves, the weight updates' phases (a histogram) and the engine's own counters
    (`Engine.stats`)."""

    def __init__(self, service: RolloutService):
        self.service = service

    def collect(self):
        s = self.service
        values = {
            "running_groups": ("Groups being generated", s.running_groups),
            "orphaned_groups": ("Groups whose call ended, kept for one to adopt", s.groups.orphans),
            "running_samples": ("Samples in the engine", s.engine.running),
            "tokens_generated": ("Tokens generated since start", s.throughput.total),
            "tokens_per_s": ("Generated tokens per second", s.throughput.rate()),
            "engine_version": ("Weights version the engine serves", s.engine.version),
        }
        for key, (doc, value) in values.items():
            family = gauge(f"asyncrl_rollout_{key}", doc, ["experiment"])
            family.add_metric([s.experiment_id], float(value))
            yield family
        yield from s.serving.update_seconds.collect()
        for key, value in s.engine.stats().items():  # cumulative: steps, seconds, tokens
            family = CounterMetricFamily(
                f"asyncrl_rollout_engine_{key}", f"Engine {key} since start", labels=["experiment"]
            )
            family.add_metric([s.experiment_id], float(value))
            yield family


async def create_rollout(
    nats_url: str,
    engine: Engine,
    port: int = 0,
    scheduler: str | None = None,
    register: bool = True,
    capacity: int = DEFAULT_CAPACITY,
    host: str = "127.0.0.1",
    engine_kind: str | None = None,
    openai_port: int = 0,
    metrics_port: int | None = None,
) -> tuple[ServiceRuntime, RolloutService]:
    """Start a rollout worker around `engine`; returns (runtime, service): `runtime.port` is
    the gRPC port, `await runtime.close()` stops everything in reverse order.

    With register=True it registers with the scheduler (`scheduler`, else ASYNCRL_SCHEDULER)
    as a rollout worker of `capacity` concurrent groups; its load is its running groups."""
    runtime = ServiceRuntime("rollout", host=host)
    try:
        nc = await runtime.connect_nats(nats_url)
        await ensure_stream(js := nc.jetstream())
        await engine.start()
        service = RolloutService(
            engine,
            js,
            engine_kind=engine_kind,
            worker=lambda: runtime.worker_id or f"rollout@{runtime.address}",
            openai_port=openai_port,
        )
        runtime.on_close(service.close)
        work = RecentWork(lambda: service.running_groups)
        runtime.busy = work.busy  # a hand-over of a busy rollout waits for the successor
        runtime.serving = lambda: bool(service.experiment_id)  # to load the experiment's weights
        servicer = RolloutServicer(service)
        await runtime.serve(
            [(rollout_pb2_grpc.add_RolloutServicer_to_server, servicer)],
            [SERVICE_NAME],
            port=port,
        )
        if register:
            await runtime.register(
                common_pb2.WORKER_KIND_ROLLOUT,
                capacity=capacity,
                scheduler=scheduler,
                load=work,
                device=engine.device_name,
                on_beat=lambda beat: service.rewards.known(beat.reward_addresses),
                on_agent=servicer.follow,
            )
        await runtime.serve_metrics(metrics_port, RolloutCollector(service))
    except BaseException:
        await runtime.close()
        raise
    log.info(
        "rollout_ready", port=runtime.port, engine=service.engine_kind, worker=service.worker,
        capacity=capacity,
    )  # fmt: skip
    return runtime, service
