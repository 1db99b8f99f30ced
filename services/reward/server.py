"""Reward gRPC service: a thin servicer over ScoringPool. Stateless; scale by adding replicas."""

from __future__ import annotations

import math
import time

from prometheus_client.registry import Collector

from asyncrl import rewards
from asyncrl.logging import get_logger
from asyncrl.metrics import gauge
from asyncrl.runtime import ServiceRuntime
from asyncrl.spec import SpecError
from asyncrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
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


class RewardCollector(Collector):
    """Scoring processes and the items being scored now."""

    def __init__(self, pool: ScoringPool):
        self.pool = pool

    def collect(self):
        workers = gauge("asyncrl_reward_workers", "Scoring processes")
        workers.add_metric([], float(self.pool.workers))
        in_flight = gauge("asyncrl_reward_in_flight", "Items being scored")
        in_flight.add_metric([], float(self.pool.in_flight))
        yield from (workers, in_flight)


class RewardService(reward_pb2_grpc.RewardServicer):
    def __init__(self, pool: ScoringPool):
        self.pool = pool

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

    async def ListRewardFunctions(self, request, context):
        return reward_pb2.ListRewardFunctionsResponse(names=list(rewards.REWARD_FUNCTIONS))


async def create_reward(
    port: int = 0,
    workers: int | None = None,
    scheduler: str | None = None,
    register: bool = True,
    host: str = "127.0.0.1",
    metrics_port: int | None = None,
) -> tuple[ServiceRuntime, RewardService]:
    """Start the reward service; returns (runtime, service), `runtime.port` is the bound port
    and `await runtime.close()` stops the server and its process pool. With register=True it
    registers with the scheduler (`scheduler`, else ASYNCRL_SCHEDULER) as a reward worker."""
    runtime = ServiceRuntime("reward", host=host)
    pool = ScoringPool(workers)
    runtime.on_close(pool.close)
    service = RewardService(pool)
    try:
        await runtime.serve(
            [(reward_pb2_grpc.add_RewardServicer_to_server, service)],
            [reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name],
            port=port,
        )
        if register:
            await runtime.register(
                common_pb2.WORKER_KIND_REWARD,
                capacity=pool.workers,
                scheduler=scheduler,
                load=lambda: pool.in_flight,
            )
        await runtime.serve_metrics(metrics_port, RewardCollector(pool))
    except BaseException:
        await runtime.close()
        raise
    log.info("reward_ready", port=runtime.port, workers=pool.workers)
    return runtime, service
