"""The Trainer gRPC servicer (thin, over TrainerService), its Prometheus collector, and
`create_trainer` for tests and `python -m services.trainer`."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from asyncrl import devices
from asyncrl.grpcutil import channel
from asyncrl.logging import get_logger
from asyncrl.metrics import gauge
from asyncrl.natsutil import ensure_stream
from asyncrl.runtime import ServiceRuntime
from asyncrl.settings import settings
from asyncrl.v1 import common_pb2, scheduler_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.trainer.metrics import DIAGNOSTIC_FIELDS
from services.trainer.service import TrainerService

log = get_logger()

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
STEP_FIELDS = (
    "loss",
    "reward_mean",
    "staleness_max",
    "tokens_per_s",
    "step_time_s",
    "quarantined",
    "replayed",
    *DIAGNOSTIC_FIELDS,
)


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, service: TrainerService):
        self.service = service

    async def GetStatus(self, request, context):
        s = self.service
        return trainer_pb2.TrainerStatus(
            worker_id=s.worker_id,
            experiment_id=s.experiment_id,
            version=s.version,
            step=s.step,
            backend=s.spec.trainer.backend if s.spec else "",
            last_step=s.last_metrics.to_proto() if s.last_metrics else None,
            state=s.state,
            message=s.message,
            fatal=s.fatal,
        )

    async def StartExperiment(self, request, context):
        version, resumed = await self.service.start_experiment(
            request.experiment_id, request.spec_json
        )
        return trainer_pb2.StartExperimentResponse(
            version=version, resumed=resumed, uri=self.service.weights_uri(version)
        )

    async def StopExperiment(self, request, context):
        await self.service.stop_experiment(request.experiment_id)
        return trainer_pb2.StopExperimentResponse()

    async def CheckpointNow(self, request, context):
        path, step = await self.service.checkpoint_now(request.experiment_id)
        return trainer_pb2.CheckpointNowResponse(path=path, step=step)


class TrainerCollector(Collector):
    """Version, step, the last step's metrics, and where the trainer's time goes (a histogram
    per phase: train_step, wait, serialize, write, commit, checkpoint, stall)."""

    def __init__(self, service: TrainerService):
        self.service = service

    def collect(self):
        s = self.service
        labels = [s.experiment_id]
        version = gauge("asyncrl_trainer_version", "Weights version trained", ["experiment"])
        version.add_metric(labels, float(s.version))
        step = gauge("asyncrl_trainer_step", "Optimizer steps taken", ["experiment"])
        step.add_metric(labels, float(s.step))
        yield from (version, step)
        for key in STEP_FIELDS:
            family = gauge(f"asyncrl_trainer_last_step_{key}", f"Last step's {key}", ["experiment"])
            if s.last_metrics is not None:
                family.add_metric(labels, float(getattr(s.last_metrics, key)))
            yield family
        yield from s.phases.collect()
        checked = CounterMetricFamily(
            "asyncrl_trainer_samples_weights_checked",
            "Samples trained, by weights fingerprint check: verified, unverified",
            labels=["experiment", "result"],
        )
        for result, n in sorted(s.samples_checked.items()):
            checked.add_metric([s.experiment_id, result], float(n))
        yield checked


async def create_trainer(
    nats_url: str,
    port: int = 0,
    scheduler: str | None = None,
    register: bool = True,
    var_dir: str | Path | None = None,
    weights_dir: str | Path | None = None,
    host: str = "127.0.0.1",
    metrics_port: int | None = None,
) -> tuple[ServiceRuntime, TrainerService]:
    """Connect to NATS, serve the Trainer API and (optionally) register with the scheduler.
    Returns (runtime, service); `await runtime.close()` stops it (the service's close takes a
    final checkpoint at the step boundary)."""
    runtime = ServiceRuntime("trainer", host=host)
    try:
        nc = await runtime.connect_nats(nats_url)
        js = nc.jetstream()
        await ensure_stream(js)
        sched_channel = channel(scheduler or settings().scheduler, runtime.name)
        runtime.on_close(sched_channel.close)
        service = TrainerService(
            js,
            scheduler_pb2_grpc.SchedulerStub(sched_channel),
            var_dir=Path(var_dir or settings().var).absolute(),
            weights_root=Path(weights_dir or settings().weights).absolute(),
            worker=lambda: runtime.worker_id,
        )
        runtime.on_close(service.close)
        await runtime.serve(
            [(trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerServicer(service))],
            [SERVICE_NAME],
            port=port,
        )
        if register:
            await runtime.register(
                common_pb2.WORKER_KIND_TRAINER,
                scheduler=scheduler,
                load=service.load,
                device=devices.describe(devices.pick_device("auto")),
            )
        await runtime.serve_metrics(metrics_port, TrainerCollector(service))
    except BaseException:
        await runtime.close()
        raise
    log.info(
        "trainer_ready",
        port=runtime.port,
        var_dir=str(service.var_dir),
        weights=str(service.weights_root),
        registered=register,
    )
    return runtime, service
