"""Reward gRPC service: a thin servicer over ScoringPool. Stateless; scale by adding replicas."""

from __future__ import annotations

import collections
import time

from prometheus_client.registry import Collector

from asyncrl import rewards
from asyncrl.convert import status_to_proto
from asyncrl.errors import BadRequest, Conflict
from asyncrl.logging import Tally, get_logger
from asyncrl.metrics import gauge
from asyncrl.runtime import ServiceRuntime
from asyncrl.spec import RewardSpec, spec_from_json
from asyncrl.types import RewardStatus, Score, ScoreItem
from asyncrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services.reward.pool import ScoringPool, stop_helpers

log = get_logger()


def items_from_proto(request: reward_pb2.ScoreRequest) -> list[ScoreItem]:
    return [
        ScoreItem(id=i.id, prompt=i.prompt, completion=i.completion, answer=i.answer)
        for i in request.items
    ]


def response_to_proto(items: list[ScoreItem], scores: list[Score]) -> reward_pb2.ScoreResponse:
    """The results in item order."""
    response = reward_pb2.ScoreResponse()
    for item, score in zip(items, scores, strict=True):
        response.results.add(
            id=item.id,
            reward=score.reward,
            status=status_to_proto(score.status),
            reason=score.reason,
        )
    return response


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
    """Scores items with the reward function of the experiment they belong to; each
    experiment's function is loaded once, when a rollout binds it here."""

    MAX_BOUND = 256
    """Experiments remembered; the oldest is forgotten first (its rollouts bind it again)."""

    def __init__(self, pool: ScoringPool):
        self.pool = pool
        self._bound: collections.OrderedDict[str, RewardSpec] = collections.OrderedDict()
        self._tally = Tally("scored", log)
        """Score calls, their items and failed items: a line per call (one per group) was
        ~10 CPU-µs of the ~300 a Score call costs the service (bench/control_plane.py); a call
        with a failed item still gets its own line."""

    async def BindExperiment(self, request, context):
        if not request.experiment_id:
            raise BadRequest("experiment_id", "required")
        reward = spec_from_json(request.spec_json).reward
        rewards.validate_reward_function(reward.function, reward.kwargs)  # imports a plugin
        self._bound[request.experiment_id] = reward
        self._bound.move_to_end(request.experiment_id)
        self.pool.slots.touch(request.experiment_id)  # its share of the processes is kept
        while len(self._bound) > self.MAX_BOUND:
            self._bound.popitem(last=False)
        log.info("experiment_bound", experiment=request.experiment_id, function=reward.function)
        return common_pb2.BindExperimentResponse()

    async def Score(self, request, context):
        reward = self._bound.get(request.experiment_id)
        if reward is None:
            raise Conflict(
                f"experiment_id: {request.experiment_id!r} is not bound here (BindExperiment first)"
            )
        if not request.items:
            return reward_pb2.ScoreResponse()
        start = time.perf_counter()
        items = items_from_proto(request)
        remaining = context.time_remaining()
        results = await self.pool.score(
            reward.function,
            reward.kwargs,
            items,
            reward.timeout_s,
            key=request.experiment_id,
            deadline=None if remaining is None else time.monotonic() + remaining,
        )
        failed = [r for r in results if r.status is RewardStatus.FAILED]
        if failed:
            log.info(
                "batch_scored",
                experiment=request.experiment_id,
                function=reward.function,
                items=len(results),
                failed=len(failed),
                seconds=round(time.perf_counter() - start, 4),
                first_failure=failed[0].reason,
            )
        self._tally.add(start, calls=1, items=len(results), failed=len(failed))
        return response_to_proto(items, results)

    async def ListRewardFunctions(self, request, context):
        return reward_pb2.ListRewardFunctionsResponse(names=list(rewards.REWARD_FUNCTIONS))


async def create_reward(
    port: int = 0,
    workers: int | None = None,
    scheduler: str | None = None,
    register: bool = True,
    host: str = "127.0.0.1",
    metrics_port: int | None = None,
    nats_url: str | None = None,
) -> tuple[ServiceRuntime, RewardService]:
    """Start the reward service; returns (runtime, service), `runtime.port` is the bound port
    and `await runtime.close()` stops the server and its process pool. With register=True it
    starts its scoring processes (`ScoringPool.warm`), then registers with the scheduler
    (`scheduler`, else ASYNCRL_SCHEDULER) as a reward worker, its heartbeats on NATS
    (`nats_url`, else NATS_URL: the only use it has for NATS)."""
    runtime = ServiceRuntime("reward", host=host)
    runtime.on_close(stop_helpers)  # after the pool's close: closed in reverse order
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
            await pool.warm()  # registered means able to score: no cold pool after a hand-over
            await runtime.register(
                common_pb2.WORKER_KIND_REWARD,
                capacity=pool.workers,
                scheduler=scheduler,
                load=lambda: pool.in_flight,
                device="cpu",
                nats_url=nats_url,
            )
        await runtime.serve_metrics(metrics_port, RewardCollector(pool))
    except BaseException:
        await runtime.close()
        raise
    log.info("reward_ready", port=runtime.port, workers=pool.workers)
    return runtime, service
