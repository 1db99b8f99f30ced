"""The Scheduler gRPC servicer (thin: decode, call the Scheduler, encode) and its factory."""

from __future__ import annotations

import asyncio

import grpc

from asyncrl.grpcutil import NotFound, create_server, rpc_errors
from asyncrl.logging import get_logger
from asyncrl.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.context import SchedulerConfig
from services.scheduler.convert import (
    eval_to_proto,
    experiment_to_proto,
    kind_from_proto,
    step_from_proto,
    step_to_proto,
    worker_to_proto,
)
from services.scheduler.core import Scheduler
from services.scheduler.experiments import ExperimentRunner
from services.scheduler.records import Event

log = get_logger()
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


def _experiment(runner: ExperimentRunner, with_history: bool = False) -> scheduler_pb2.Experiment:
    return experiment_to_proto(runner.snapshot(), with_history)


def _event(runner: ExperimentRunner, event: Event) -> scheduler_pb2.ProgressEvent:
    msg = scheduler_pb2.ProgressEvent(kind=event.kind, experiment=_experiment(runner))
    if event.step is not None:
        msg.step.CopyFrom(step_to_proto(event.step))
    if event.eval is not None:
        msg.eval.CopyFrom(eval_to_proto(event.eval))
    return msg


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    # ---- experiments -------------------------------------------------------------------------

    @rpc_errors
    async def SubmitExperiment(self, request, context):
        return _experiment(await self.scheduler.submit(request.spec))

    @rpc_errors
    async def GetExperiment(self, request, context):
        return _experiment(self.scheduler.get(request.experiment_id), request.with_history)

    @rpc_errors
    async def ListExperiments(self, request, context):
        return scheduler_pb2.ListExperimentsResponse(
            experiments=[_experiment(r) for r in self.scheduler.list()]
        )

    @rpc_errors
    async def CancelExperiment(self, request, context):
        return _experiment(await self.scheduler.cancel(request.experiment_id))

    async def WatchExperiment(self, request, context):
        """A `snapshot` first, then `step` / `eval` / `state` events as they happen and a
        `snapshot` every snapshot_interval_s; ends once the experiment is terminal."""
        try:
            runner = self.scheduler.get(request.experiment_id)
        except NotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        queue = runner.subscribe()
        try:
            yield scheduler_pb2.ProgressEvent(kind="snapshot", experiment=_experiment(runner))
            interval = self.scheduler.config.snapshot_interval_s
            while not runner.terminal:
                try:
                    event: Event = await asyncio.wait_for(queue.get(), interval)
                except TimeoutError:
                    yield scheduler_pb2.ProgressEvent(
                        kind="snapshot", experiment=_experiment(runner)
                    )
                    continue
                yield _event(runner, event)
            while not queue.empty():  # what came with the end (final eval, the state change)
                yield _event(runner, queue.get_nowait())
        finally:
            runner.unsubscribe(queue)

    # ---- workers -----------------------------------------------------------------------------

    @rpc_errors
    async def RegisterWorker(self, request, context):
        worker = self.scheduler.register(
            kind_from_proto(request.kind), request.address, request.name, request.capacity
        )
        config = self.scheduler.config
        return scheduler_pb2.RegisterWorkerResponse(
            worker_id=worker.worker_id,
            lease_ttl_s=config.lease_ttl_s,
            heartbeat_interval_s=config.heartbeat_interval_s,
        )

    @rpc_errors
    async def Heartbeat(self, request, context):
        return scheduler_pb2.HeartbeatResponse(
            known=self.scheduler.heartbeat(request.worker_id, request.load)
        )

    @rpc_errors
    async def ListWorkers(self, request, context):
        return scheduler_pb2.ListWorkersResponse(
            workers=[worker_to_proto(w) for w in self.scheduler.workers()]
        )

    # ---- trainer -----------------------------------------------------------------------------

    @rpc_errors
    async def CommitWeights(self, request, context):
        result = await self.scheduler.commit(
            request.experiment_id,
            request.version,
            request.uri,
            step_from_proto(request.metrics),
            request.trainer_id,
        )
        return scheduler_pb2.CommitWeightsResponse(
            fleet_version=result.fleet_version,
            updated=result.updated,
            fenced=result.fenced,
            stop=result.stop,
        )

    @rpc_errors
    async def ReportDropped(self, request, context):
        self.scheduler.report_dropped(request.experiment_id, [g.group_id for g in request.groups])
        return scheduler_pb2.ReportDroppedResponse()


async def create_scheduler(
    nats_url: str,
    port: int = 0,
    lease_ttl_s: float = 10.0,
    heartbeat_interval_s: float = 1.0,
    host: str = "127.0.0.1",
    **config,
) -> tuple[grpc.aio.Server, int, Scheduler]:
    """Start a scheduler serving on host:port (0 = a free port); returns (server, port,
    scheduler). `config` overrides SchedulerConfig fields. Stop with `await scheduler.stop()`."""
    scheduler = Scheduler(
        nats_url,
        SchedulerConfig(
            lease_ttl_s=lease_ttl_s, heartbeat_interval_s=heartbeat_interval_s, **config
        ),
    )
    await scheduler.start()
    try:
        server, bound = await create_server(
            [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, SchedulerServicer(scheduler))],
            [SERVICE_NAME],
            port=port,
            host=host,
        )
    except BaseException:
        await scheduler.stop()
        raise
    scheduler.server = server
    log.info("scheduler_serving", port=bound, host=host)
    return server, bound, scheduler
