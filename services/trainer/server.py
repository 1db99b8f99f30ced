"""The Trainer gRPC servicer (thin, over TrainerService) and `create_trainer` for tests and
`python -m services.trainer`."""

from __future__ import annotations

import os
from pathlib import Path

from asyncrl.grpcutil import channel, create_server, rpc_errors
from asyncrl.logging import get_logger
from asyncrl.natsutil import connect, ensure_stream
from asyncrl.retry import connect_policy
from asyncrl.v1 import common_pb2, scheduler_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from asyncrl.weights import weight_root
from asyncrl.worker import WorkerAgent, advertise_host, scheduler_address
from services.trainer.service import TrainerService

log = get_logger()

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, service: TrainerService):
        self.service = service

    @rpc_errors
    async def GetStatus(self, request, context):
        return self.service.status()

    @rpc_errors
    async def StartExperiment(self, request, context):
        version, resumed = await self.service.start_experiment(request.experiment_id, request.spec)
        return trainer_pb2.StartExperimentResponse(
            version=version, resumed=resumed, uri=self.service.weights_uri(version)
        )

    @rpc_errors
    async def StopExperiment(self, request, context):
        await self.service.stop_experiment(request.experiment_id)
        return trainer_pb2.StopExperimentResponse()

    @rpc_errors
    async def CheckpointNow(self, request, context):
        path, step = await self.service.checkpoint_now(request.experiment_id)
        return trainer_pb2.CheckpointNowResponse(path=path, step=step)


def var_root() -> Path:
    return Path(os.environ.get("ASYNCRL_VAR", "var")).absolute()


async def create_trainer(
    nats_url: str,
    port: int = 0,
    scheduler: str | None = None,
    register: bool = True,
    var_dir: str | Path | None = None,
    weights_dir: str | Path | None = None,
    host: str = "127.0.0.1",
):
    """Connect to NATS, start the Trainer gRPC server and (optionally) register with the
    scheduler. Returns (server, port, service); `await service.close()` then
    `await server.stop(grace)` shut it down."""
    async for attempt in connect_policy():
        with attempt:
            nc = await connect(nats_url)
    js = nc.jetstream()
    await ensure_stream(js)
    sched_channel = channel(scheduler or scheduler_address())
    service = TrainerService(
        js,
        scheduler_pb2_grpc.SchedulerStub(sched_channel),
        var_dir=Path(var_dir) if var_dir else var_root(),
        weights_root=Path(weights_dir).absolute() if weights_dir else weight_root(),
    )
    service.on_close(nc.drain)
    service.on_close(sched_channel.close)
    server, bound = await create_server(
        [(trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerServicer(service))],
        [SERVICE_NAME],
        port=port,
        host=host,
    )
    if register:
        agent = WorkerAgent(
            common_pb2.WORKER_KIND_TRAINER,
            f"{advertise_host()}:{bound}",
            scheduler=scheduler,
            load_fn=service.load,
        )
        service.worker_id = await agent.start()
        service.on_close(agent.stop)
    log.info(
        "trainer_listening",
        port=bound,
        var_dir=str(service.var_dir),
        weights=str(service.weights_root),
        registered=register,
    )
    return server, bound, service
