"""Reward gRPC service: a thin servicer over ScoringPool. Stateless; scale by adding replicas."""

from __future__ import annotations

import math
import time

from asyncrl import rewards
from asyncrl.grpcutil import create_server, rpc_errors
from asyncrl.logging import get_logger
from asyncrl.spec import SpecError
from asyncrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from asyncrl.worker import WorkerAgent, advertise_host
from services.reward.pool import Item, Result, ScoringPool, Status

log = get_logger()

DEFAULT_TIMEOUT_S = 5.0
"""Per-item timeout when a request leaves timeout_s unset (the spec's default)."""

_STATUS = {Status.OK: common_pb2.REWARD_STATUS_OK, Status.FAILED: common_pb2.REWARD_STATUS_FAILED}


def items_from_proto(request: reward_pb2.ScoreRequest) -> list[Item]:
    return [Item(i.id, i.completion, i.answer, i.prompt) for i in request.items]


def result_to_proto(result: Result) -> reward_pb2.ScoreResult:
    return reward_pb2.ScoreResult(
        id=result.id, reward=result.reward, status=_STATUS[result.status], reason=result.reason
    )


class RewardService(reward_pb2_grpc.RewardServicer):
    def __init__(self, pool: ScoringPool):
        self.pool = pool
        self.server = None
        self.agent: WorkerAgent | None = None

    @rpc_errors
    async def Score(self, request, context):
        kwargs = dict(request.kwargs)
        rewards.validate_reward_function(request.function, kwargs)
        timeout_s = request.timeout_s or DEFAULT_TIMEOUT_S
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise SpecError("timeout_s", f"must be a positive number of seconds, got {timeout_s}")
        if not request.items:
            return reward_pb2.ScoreResponse()
        start = time.perf_counter()
        results = await self.pool.score(
            request.function, kwargs, items_from_proto(request), timeout_s
        )
        failed = [r for r in results if r.status is Status.FAILED]
        log.info(
            "batch_scored",
            function=request.function,
            items=len(results),
            failed=len(failed),
            seconds=round(time.perf_counter() - start, 4),
            first_failure=failed[0].reason if failed else None,
        )
        return reward_pb2.ScoreResponse(results=[result_to_proto(r) for r in results])

    @rpc_errors
    async def ListRewardFunctions(self, request, context):
        return reward_pb2.ListRewardFunctionsResponse(names=list(rewards.REWARD_FUNCTIONS))

    async def stop(self, grace: float = 5.0) -> None:
        """Graceful stop: leave the registry, finish in-flight RPCs, then shut the pool down."""
        if self.agent:
            await self.agent.stop()
        if self.server:
            await self.server.health_servicer.enter_graceful_shutdown()
            await self.server.stop(grace)
        await self.pool.close()
        log.info("reward_stopped")


async def create_reward(
    port: int = 0,
    workers: int | None = None,
    scheduler: str | None = None,
    register: bool = True,
    host: str = "127.0.0.1",
):
    """Start the reward service; returns (server, port, service). `await service.stop()` stops
    the server and its process pool. With register=True it registers with the scheduler
    (`scheduler` address, else ASYNCRL_SCHEDULER) as a WORKER_KIND_REWARD worker."""
    pool = ScoringPool(workers)
    service = RewardService(pool)
    server, bound = await create_server(
        [(reward_pb2_grpc.add_RewardServicer_to_server, service)],
        [reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name],
        port=port,
        host=host,
    )
    service.server = server
    log.info("reward_serving", port=bound, workers=pool.workers)
    if register:
        service.agent = WorkerAgent(
            common_pb2.WORKER_KIND_REWARD,
            f"{advertise_host()}:{bound}",
            capacity=pool.workers,
            scheduler=scheduler,
            load_fn=lambda: pool.in_flight,
        )
        try:
            await service.agent.start()
        except BaseException:
            await service.stop(grace=0)
            raise
    return server, bound, service
