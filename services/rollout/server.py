"""Rollout gRPC server: a thin servicer over RolloutService, plus proto <-> domain conversion.

`create_rollout` connects to NATS (ensuring the trajectory stream), starts the engine, serves
Rollout + health + reflection, and registers with the scheduler as a rollout worker, all on
one `ServiceRuntime`; `await runtime.close()` stops it gracefully.
"""

from __future__ import annotations

import grpc
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from asyncrl.logging import get_logger
from asyncrl.metrics import gauge
from asyncrl.natsutil import ensure_stream
from asyncrl.runtime import ServiceRuntime
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


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, service: RolloutService):
        self.service = service

    async def BindExperiment(self, request, context):
        await self.service.bind(request.experiment_id, request.spec_json)
        return common_pb2.BindExperimentResponse()

    async def GenerateGroup(self, request, context):
        try:
            summary = await self.service.generate_group(job_from_proto(request))
        except RewardUnavailable as e:
            # not the group's fate: the scheduler re-queues it under the same id, and the
            # marker tells it this worker is fine (no fence)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e), trailing_metadata=(FAULT,))
        return summary_to_proto(summary)

    async def AbortGroups(self, request, context):
        aborted = self.service.abort_unpublished(
            request.experiment_id, list(request.group_ids), request.reason or "aborted"
        )
        return rollout_pb2.AbortGroupsResponse(aborted=aborted)

    async def UpdateWeights(self, request, context):
        r = await self.service.update_weights(request.experiment_id, request.version, request.uri)
        return rollout_pb2.UpdateWeightsResponse(
            version=r.version,
            seconds=r.seconds,
            interrupted=r.interrupted,
            read_s=r.phases.read_s,
            pause_s=r.phases.pause_s,
            load_s=r.phases.load_s,
            resume_s=r.phases.resume_s,
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
    """Running groups/samples, tokens generated, the version the engine serves, the weight
    updates' phases (a histogram) and the engine's own counters (`Engine.stats`)."""

    def __init__(self, service: RolloutService):
        self.service = service

    def collect(self):
        s = self.service
        values = {
            "running_groups": ("Groups being generated", s.running_groups),
            "running_samples": ("Samples in the engine", s.engine.running),
            "tokens_generated": ("Tokens generated since start", s.throughput.total),
            "tokens_per_s": ("Generated tokens per second", s.throughput.rate()),
            "engine_version": ("Weights version the engine serves", s.engine.version),
        }
        for key, (doc, value) in values.items():
            family = gauge(f"asyncrl_rollout_{key}", doc, ["experiment"])
            family.add_metric([s.experiment_id], float(value))
            yield family
        yield from s.update_seconds.collect()
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
        js = nc.jetstream()
        await ensure_stream(js)
        await engine.start()
        service = RolloutService(
            engine,
            js,
            engine_kind=engine_kind,
            worker=lambda: runtime.worker_id or f"rollout@{runtime.address}",
            openai_port=openai_port,
        )
        runtime.on_close(service.close)
        await runtime.serve(
            [(rollout_pb2_grpc.add_RolloutServicer_to_server, RolloutServicer(service))],
            [SERVICE_NAME],
            port=port,
        )
        if register:
            await runtime.register(
                common_pb2.WORKER_KIND_ROLLOUT,
                capacity=capacity,
                scheduler=scheduler,
                load=lambda: service.running_groups,
            )
        await runtime.serve_metrics(metrics_port, RolloutCollector(service))
    except BaseException:
        await runtime.close()
        raise
    log.info(
        "rollout_ready",
        port=runtime.port,
        engine=service.engine_kind,
        worker=service.worker,
        capacity=capacity,
    )
    return runtime, service
