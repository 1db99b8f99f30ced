"""The trainer's calls to the scheduler. Each is idempotent (per version, per group id), so each
is retried on UNAVAILABLE for as long as a scheduler restart takes."""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.retry import idempotent_rpc
from asyncrl.types import StepMetrics, TrajectoryGroup
from asyncrl.v1 import scheduler_pb2
from services.trainer.metrics import drop_reason

COMMIT_TIMEOUT_S = 300.0  # with trainer.weight_sync nccl the broadcast runs beside the commit
REPORT_TIMEOUT_S = 10.0
SCHEDULER_RETRY_S = 120.0  # keep retrying UNAVAILABLE this long (a scheduler restart)


class SchedulerCalls:
    """CommitWeights and ReportDropped for one experiment."""

    def __init__(self, stub, experiment_id: str, worker: Callable[[], str], log):
        self.stub = stub  # scheduler_pb2_grpc.SchedulerStub
        self.experiment_id = experiment_id
        self._worker = worker
        self.log = log

    async def commit(
        self, uri: str, m: StepMetrics, fingerprint: str = "", broadcast_store: str = ""
    ) -> scheduler_pb2.CommitWeightsResponse:
        """CommitWeights (with the version's weights fingerprint, "" if unknown, and the address
        of the broadcast group's store, "" none) is idempotent per (experiment, version): safe
        to retry. Each attempt carries this trainer's worker id as of then (a new one once it
        re-registered with a restarted scheduler, which answers UNAVAILABLE to an id it no
        longer knows)."""
        metrics = m.to_proto()
        async for attempt in idempotent_rpc(attempts=30, max_delay_s=SCHEDULER_RETRY_S):
            with attempt:
                req = scheduler_pb2.CommitWeightsRequest(
                    experiment_id=self.experiment_id,
                    version=m.version,
                    uri=uri,
                    metrics=metrics,
                    trainer_id=self._worker(),
                    fingerprint=fingerprint,
                    broadcast_store=broadcast_store,
                )
                return await self.stub.CommitWeights(req, timeout=COMMIT_TIMEOUT_S)

    async def report_dropped(
        self, stale: list[TrajectoryGroup], trainer_version: int, eta: int
    ) -> None:
        """ReportDropped (idempotent per group id: safe to retry), then logged."""
        req = scheduler_pb2.ReportDroppedRequest(
            experiment_id=self.experiment_id,
            groups=[
                scheduler_pb2.DroppedGroup(
                    group_id=g.group_id,
                    prompt_id=g.prompt_id,
                    start_version=g.start_version,
                    trainer_version=trainer_version,
                    reason=drop_reason(g, trainer_version, eta),
                )
                for g in stale
            ],
        )
        async for attempt in idempotent_rpc(attempts=30, max_delay_s=SCHEDULER_RETRY_S):
            with attempt:
                await self.stub.ReportDropped(req, timeout=REPORT_TIMEOUT_S)
        self.log.info(
            "groups_dropped_stale",
            version=trainer_version,
            eta=eta,
            groups=[g.group_id for g in stale],
        )
