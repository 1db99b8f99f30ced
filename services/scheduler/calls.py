"""The calls an experiment runner makes to its workers, each with a deadline: GenerateGroup
requests, UpdateWeights (and the set of rollouts that serve the fleet version), and the
trainer's StartExperiment / StopExperiment."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from asyncrl.spec import ExperimentSpec, spec_to_proto
from asyncrl.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.scheduler.context import ChannelPool
from services.scheduler.dataset import Prompt, Ticket
from services.scheduler.evaluation import EvalRound
from services.scheduler.registry import Worker


@dataclass
class InFlight:
    """One GenerateGroup call in flight: a training group (`ticket`) or an eval group."""

    group_id: str
    worker: Worker
    start_version: int
    ticket: Ticket | None = None
    eval_round: EvalRound | None = None
    eval_index: int = 0
    eval_attempt: int = 0
    task: asyncio.Task | None = None


class WorkerCalls:
    """Builds and sends one experiment's requests to rollouts and trainers."""

    def __init__(self, experiment_id: str, spec: ExperimentSpec, channels: ChannelPool):
        self.experiment_id = experiment_id
        self.spec = spec
        self.spec_pb = spec_to_proto(spec)
        self.channels = channels

    def train_request(
        self, prompt: Prompt, ticket: Ticket, version: int, reward_addresses: list[str]
    ) -> rollout_pb2.GenerateGroupRequest:
        return rollout_pb2.GenerateGroupRequest(
            experiment_id=self.experiment_id,
            group_id=ticket.group_id(self.experiment_id),
            prompt_id=prompt.prompt_id,
            prompt=prompt.prompt,
            answer=prompt.answer,
            n=self.spec.rollout.n_samples,
            gconfig=self.spec_pb.rollout.gconfig,
            expected_version=version,
            eval=False,
            reward=self.spec_pb.reward,
            filter=self.spec.rollout.filter,
            reward_addresses=reward_addresses,
            epoch=ticket.epoch,
            workflow=self.spec_pb.rollout.workflow,
        )

    def eval_request(
        self,
        prompt: Prompt,
        eval_round: EvalRound,
        attempt: int,
        version: int,
        reward_addresses: list[str],
    ) -> rollout_pb2.GenerateGroupRequest:
        group_id = f"{self.experiment_id}-eval-v{eval_round.version}-p{prompt.index}-a{attempt}"
        return rollout_pb2.GenerateGroupRequest(
            experiment_id=self.experiment_id,
            group_id=group_id,
            prompt_id=prompt.prompt_id,
            prompt=prompt.prompt,
            answer=prompt.answer,
            n=self.spec.eval.n_samples,
            gconfig=self.spec_pb.eval.gconfig,
            expected_version=version,
            eval=True,
            reward=self.spec_pb.reward,
            filter="none",
            reward_addresses=reward_addresses,
            workflow=self.spec_pb.rollout.workflow,
        )

    async def generate_group(
        self, worker: Worker, request: rollout_pb2.GenerateGroupRequest
    ) -> rollout_pb2.GroupSummary:
        stub = rollout_pb2_grpc.RolloutStub(self.channels.get(worker.address))
        return await stub.GenerateGroup(request, timeout=self.spec.rollout.group_timeout_s)

    async def update_weights(
        self, worker: Worker, version: int, uri: str, timeout: float
    ) -> rollout_pb2.UpdateWeightsResponse:
        stub = rollout_pb2_grpc.RolloutStub(self.channels.get(worker.address))
        request = rollout_pb2.UpdateWeightsRequest(
            experiment_id=self.experiment_id,
            version=version,
            uri=uri,
            tokenizer_path=self.spec.model.tokenizer_path or self.spec.model.path,
            engine=self.spec.rollout.engine,
        )
        return await stub.UpdateWeights(request, timeout=timeout)

    async def start_trainer(
        self, trainer: Worker, timeout: float
    ) -> trainer_pb2.StartExperimentResponse:
        stub = trainer_pb2_grpc.TrainerStub(self.channels.get(trainer.address))
        request = trainer_pb2.StartExperimentRequest(
            experiment_id=self.experiment_id, spec=self.spec_pb
        )
        return await stub.StartExperiment(request, timeout=timeout)

    async def stop_trainer(self, trainer: Worker, timeout: float) -> None:
        stub = trainer_pb2_grpc.TrainerStub(self.channels.get(trainer.address))
        await stub.StopExperiment(
            trainer_pb2.StopExperimentRequest(experiment_id=self.experiment_id), timeout=timeout
        )


class FleetWeights:
    """Which bound rollouts serve the fleet version. `lock` is held across a commit (broadcast
    then version change), so a rollout being synced sees a commit fully done or not started."""

    def __init__(self, calls: WorkerCalls, fleet: Callable[[], tuple[int, str]]):
        self.calls = calls
        self.fleet = fleet
        """Returns the fleet's (version, uri)."""
        self.ready: set[str] = set()
        self.lock = asyncio.Lock()

    async def sync(
        self, worker: Worker, still_bound: Callable[[], bool], timeout: float
    ) -> int | None:
        """Load the fleet's weights into `worker` (again if a commit lands meanwhile); returns
        the version, or None if it was unbound meanwhile. Raises AioRpcError on failure."""
        while True:
            version, uri = self.fleet()
            await self.calls.update_weights(worker, version, uri, timeout)
            async with self.lock:
                if not still_bound():
                    return None
                if version == self.fleet()[0]:
                    worker.version = version
                    self.ready.add(worker.worker_id)
                    return version

    async def broadcast(
        self, workers: list[Worker], version: int, uri: str, timeout: float
    ) -> list[tuple[Worker, str]]:
        """UpdateWeights to all `workers` in parallel (call with `lock` held); returns the ones
        that failed or lagged past the deadline, with the reason."""
        results = await asyncio.gather(
            *(self.calls.update_weights(w, version, uri, timeout) for w in workers),
            return_exceptions=True,
        )
        failed = []
        for w, result in zip(workers, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError):
                failed.append((w, result.code().name))
            elif isinstance(result, BaseException):
                failed.append((w, type(result).__name__))
            else:
                w.version = version
        return failed
