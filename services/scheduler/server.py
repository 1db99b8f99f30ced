"""The Scheduler gRPC servicer (thin: decode, call the Scheduler, encode) and its factory."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

from prometheus_client.registry import Collector

from asyncrl.errors import NotFound
from asyncrl.liveness import live_subject
from asyncrl.logging import get_logger
from asyncrl.metrics import gauge
from asyncrl.runtime import ServiceRuntime
from asyncrl.security import caller
from asyncrl.types import StepMetrics
from asyncrl.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.config import SchedulerConfig
from services.scheduler.convert import experiment_to_proto, kind_from_proto, worker_to_proto
from services.scheduler.core import Scheduler
from services.scheduler.experiments import ExperimentRunner
from services.scheduler.fleet import WEIGHTS_CHECKED
from services.scheduler.leadership import STEPPED_DOWN, Leadership, holder_id
from services.scheduler.records import Event
from services.scheduler.registry import WorkerKind
from services.scheduler.state import open_bucket

log = get_logger()
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


def _experiment(runner: ExperimentRunner, with_history: bool = False) -> scheduler_pb2.Experiment:
    return experiment_to_proto(runner.snapshot(), with_history)


def _event(runner: ExperimentRunner, event: Event) -> scheduler_pb2.ProgressEvent:
    msg = scheduler_pb2.ProgressEvent(kind=event.kind, experiment=_experiment(runner))
    if event.step is not None:
        msg.step.CopyFrom(event.step.to_proto())
    if event.eval is not None:
        msg.eval.CopyFrom(event.eval.to_proto())
    return msg


def _tenant() -> str:
    """The caller's tenant ("": the operator, or security off)."""
    who = caller()
    return who.tenant if who is not None else ""


def _sees(experiment_tenant: str) -> bool:
    """Whether the caller may see an experiment of `experiment_tenant` (docs/tenants.md;
    security off: everyone is the operator)."""
    who = caller()
    return who is None or who.sees(experiment_tenant)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Experiments are the caller's tenant's only: another tenant's answer NOT_FOUND exactly as
    an id that does not exist (never PERMISSION_DENIED, which would confirm it does); the
    operator (a token without a tenant) sees every one."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def _get(self, experiment_id: str) -> ExperimentRunner:
        runner = self.scheduler.get(experiment_id)
        if not _sees(runner.record.tenant):
            raise NotFound(f"experiment_id: no experiment {experiment_id!r}")  # as core's
        return runner

    # ---- experiments -------------------------------------------------------------------------

    async def SubmitExperiment(self, request, context):
        return _experiment(await self.scheduler.submit(request.spec_json, _tenant()))

    async def GetExperiment(self, request, context):
        return _experiment(self._get(request.experiment_id), request.with_history)

    async def ListExperiments(self, request, context):
        mine = [r for r in self.scheduler.list() if _sees(r.record.tenant)]
        return scheduler_pb2.ListExperimentsResponse(experiments=[_experiment(r) for r in mine])

    async def CancelExperiment(self, request, context):
        return _experiment(await self.scheduler.cancel(self._get(request.experiment_id).id))

    async def ResumeExperiment(self, request, context):
        return _experiment(await self.scheduler.resume(self._get(request.experiment_id).id))

    async def WatchExperiment(self, request, context):
        """A `snapshot` first, then `step` / `eval` / `state` events as they happen and a
        `snapshot` every snapshot_interval_s; ends once the experiment is terminal."""
        runner = self._get(request.experiment_id)  # NotFound: the interceptor's NOT_FOUND
        queue = runner.book.subscribe()
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
            runner.book.unsubscribe(queue)

    # ---- workers -----------------------------------------------------------------------------

    async def RegisterWorker(self, request, context):
        worker = self.scheduler.register(
            kind_from_proto(request.kind),
            request.address,
            request.name,
            request.capacity,
            caller(),
            device=request.device,
            incarnation=request.incarnation,
        )
        config = self.scheduler.config
        return scheduler_pb2.RegisterWorkerResponse(
            worker_id=worker.worker_id,
            lease_ttl_s=config.lease_ttl_s,
            heartbeat_interval_s=config.heartbeat_interval_s,
            heartbeat_subject=live_subject(worker.kind.value, worker.worker_id),
            lease_key=worker.lease_key,
        )

    async def Heartbeat(self, request, context):
        known = self.scheduler.heartbeat(
            request.worker_id, request.load, caller(), leaving=request.leaving
        )
        return scheduler_pb2.HeartbeatResponse(
            known=known, reward_addresses=self.scheduler.registry.reward_addresses()
        )

    async def ListWorkers(self, request, context):
        """Every worker (the fleet is shared); to a tenant, the experiment a worker serves
        and its version only when it is the tenant's own (of a shared rollout, the tenant's
        experiments among those it serves)."""
        workers = [worker_to_proto(w) for w in self.scheduler.workers()]
        for w in workers:
            ids = w.experiment_id.split(",") if w.experiment_id else []
            visible = [i for i in ids if self._visible_id(i)]
            if visible != ids:
                w.experiment_id, w.version = ",".join(visible), -1
        return scheduler_pb2.ListWorkersResponse(workers=workers)

    def _visible_id(self, experiment_id: str) -> bool:
        runner = self.scheduler.runners.get(experiment_id)
        return not _tenant() or (runner is not None and _sees(runner.record.tenant))

    # ---- trainer -----------------------------------------------------------------------------

    async def CommitWeights(self, request, context):
        result = await self.scheduler.commit(
            request.experiment_id,
            request.version,
            request.uri,
            StepMetrics.from_proto(request.metrics),
            request.trainer_id,
            caller(),
            request.fingerprint,
            request.broadcast_store,
        )
        return scheduler_pb2.CommitWeightsResponse(
            fleet_version=result.fleet_version, stop=result.stop
        )

    async def ReportDropped(self, request, context):
        await self.scheduler.report_dropped(
            request.experiment_id, [g.group_id for g in request.groups], caller()
        )
        return scheduler_pb2.ReportDroppedResponse()


class SchedulerCollector(Collector):
    """Per experiment (label `experiment`): progress counters, the last step and eval, and the
    fleet's weight updates by phase (a histogram); and the registered workers by kind."""

    PROGRESS = {
        "version": "Fleet version: the weights the rollouts serve",
        "accepted": "Groups accepted into training",
        "rejected": "Groups rejected by the filters",
        "failed": "Groups that failed",
        "stale_dropped": "Groups dropped as too stale",
        "running": "Groups in flight",
        "trained_groups": "Groups the trainer trained on",
        "rollout_tokens_per_s": "Rollout throughput in generated tokens per second",
    }
    LAST_STEP = ("loss", "reward_mean", "staleness_max")

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self):
        yield from self._experiments()
        workers = gauge("asyncrl_scheduler_workers", "Registered workers by kind", ["kind"])
        counts = {str(kind): 0 for kind in WorkerKind}
        for worker in self.scheduler.workers():
            counts[str(worker.kind)] += 1
        for kind, n in counts.items():
            workers.add_metric([kind], float(n))
        yield workers
        yield from self.scheduler.fleet_seconds.collect()
        yield from WEIGHTS_CHECKED.collect()

    def _experiments(self):
        label = ["experiment"]
        progress = {
            key: gauge(f"asyncrl_scheduler_{key}", doc, label) for key, doc in self.PROGRESS.items()
        }
        last_step = {
            key: gauge(f"asyncrl_scheduler_last_step_{key}", f"Last step's {key}", label)
            for key in self.LAST_STEP
        }
        accuracy = gauge("asyncrl_scheduler_last_eval_accuracy", "Accuracy of the last eval", label)
        for runner in self.scheduler.runners.values():
            record = runner.snapshot()
            for key, family in progress.items():
                family.add_metric([record.id], float(getattr(record.progress, key)))
            if record.history:
                for key, family in last_step.items():
                    family.add_metric([record.id], float(getattr(record.history[-1], key)))
            if record.evals:
                accuracy.add_metric([record.id], float(record.evals[-1].accuracy))
        yield from progress.values()
        yield from last_step.values()
        yield accuracy


def exit_stepped_down(why: str) -> None:
    """Another scheduler holds the lease: exit now, without a flush or a goodbye (the
    supervisor starts this one again, as a standby)."""
    log.error("scheduler_exiting_stepped_down", reason=why)
    os._exit(STEPPED_DOWN)


async def create_scheduler(
    nats_url: str,
    port: int = 0,
    host: str = "127.0.0.1",
    metrics_port: int | None = None,
    grace_s: float = 2.0,
    take_over: Callable[[], Awaitable[None]] | None = None,
    on_lost: Callable[[str], None] = exit_stepped_down,
    stopping: Callable[[], bool] = lambda: False,
    **config,
) -> tuple[ServiceRuntime, Scheduler]:
    """Start a scheduler serving on host:port (0 = a free port); returns (runtime, scheduler),
    `runtime.port` is the bound port. `config` overrides SchedulerConfig fields (lease_ttl_s,
    heartbeat_interval_s, ...; their defaults are SchedulerConfig's). Stop with
    `await runtime.close()` (experiment state stays in NATS KV; a new scheduler resumes it).
    `take_over`: awaited once connected, before the experiments are read (a successor's wait
    for its predecessor to close: `asyncrl.supervisor.handover`).

    It then waits as a standby until it holds the scheduler's lease (`Leadership.acquire`;
    StandbyStopped once `stopping()`), and only then reads the experiments and binds `port`.
    `on_lost`: called when another scheduler took the lease over (default: exit at once)."""
    runtime = ServiceRuntime("scheduler", host=host, grace_s=grace_s)
    try:
        nc = await runtime.connect_nats(nats_url)
        js = nc.jetstream()
        scheduler_config = SchedulerConfig(**config)
        if take_over is not None:
            await take_over()
        ttl_s = scheduler_config.leader_lease_s
        leadership = Leadership(await open_bucket(js), holder_id(port), ttl_s, on_lost)
        await leadership.acquire(stopping)
        runtime.on_close(leadership.release)  # after the scheduler's last flush
        scheduler = Scheduler(js, scheduler_config, leadership)
        await scheduler.start()
        runtime.on_close(scheduler.close)
        await runtime.serve(
            [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, SchedulerServicer(scheduler))],
            [SERVICE_NAME],
            port=port,
        )
        await runtime.serve_metrics(metrics_port, SchedulerCollector(scheduler))
        await scheduler.liveness.announce_start()  # the workers register now, not in a beat
    except BaseException:
        await runtime.close()
        raise
    return runtime, scheduler
