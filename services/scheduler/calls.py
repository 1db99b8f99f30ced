"""The calls an experiment runner makes to its workers, each with a deadline: BindExperiment
(the spec, once per binding, to rollouts and reward workers), GenerateGroups calls,
UpdateWeights, and the trainer's StartExperiment / StopExperiment."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from asyncrl.spec import ExperimentSpec, spec_to_json
from asyncrl.ticket import Ticket
from asyncrl.v1 import (
    common_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from services.scheduler.context import ChannelPool
from services.scheduler.dataset import Prompt
from services.scheduler.evaluation import EvalRound
from services.scheduler.registry import Worker


class BindRefused(Exception):
    """A worker refused the experiment itself: INVALID_ARGUMENT to BindExperiment (it cannot
    load a plugin the spec names, say). `details` is the worker's message."""

    def __init__(self, details: str):
        super().__init__(f"refused the experiment: {details}")
        self.details = details


async def _bind(call, request: common_pb2.BindExperimentRequest, timeout: float) -> None:
    """BindExperiment; INVALID_ARGUMENT becomes BindRefused, other errors stay AioRpcError."""
    try:
        await call(request, timeout=timeout)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise BindRefused(e.details() or "invalid argument") from e
        raise


@dataclass
class InFlight:
    """One group in flight: a training group (`ticket`) or an eval group."""

    group_id: str
    worker: Worker
    start_version: int
    ticket: Ticket | None = None
    eval_round: EvalRound | None = None
    eval_index: int = 0
    eval_attempt: int = 0
    call: GroupsCall | None = None
    """The GenerateGroups call it went out in (None until the dispatch pass sends it)."""
    abort_sent: bool = False
    """AbortGroups was sent for it (too stale unless already published)."""


@dataclass
class GroupsCall:
    """One GenerateGroups call: the groups one dispatch pass sent to one rollout."""

    worker: Worker
    open: dict[str, InFlight]
    """Its groups not answered yet and not withdrawn."""
    task: asyncio.Task | None = None


class WorkerCalls:
    """Builds and sends one experiment's requests to rollouts and trainers."""

    def __init__(self, experiment_id: str, spec: ExperimentSpec, channels: ChannelPool):
        self.experiment_id = experiment_id
        self.spec = spec
        self.spec_json = spec_to_json(spec)
        self.channels = channels

    def group_request(
        self,
        group_id: str,
        prompt: Prompt,
        reward_addresses: list[str],
        *,
        eval: bool,
        epoch: int = 0,
    ) -> rollout_pb2.GenerateGroupRequest:
        """A training group or an eval group; the rollout takes n, the sampling settings, the
        workflow and the filter from the spec it was bound with."""
        return rollout_pb2.GenerateGroupRequest(
            experiment_id=self.experiment_id,
            group_id=group_id,
            prompt_id=prompt.prompt_id,
            prompt=prompt.prompt,
            answer=prompt.answer,
            eval=eval,
            reward_addresses=reward_addresses,
            epoch=epoch,
        )

    def train_group_id(self, ticket: Ticket) -> str:
        return ticket.group_id(self.experiment_id)

    def eval_group_id(self, eval_round: EvalRound, prompt: Prompt, attempt: int) -> str:
        return f"{self.experiment_id}-eval-v{eval_round.version}-p{prompt.index}-a{attempt}"

    def _bind_request(self) -> common_pb2.BindExperimentRequest:
        return common_pb2.BindExperimentRequest(
            experiment_id=self.experiment_id, spec_json=self.spec_json
        )

    async def bind(self, worker: Worker, timeout: float) -> None:
        """Send a rollout the experiment's spec: once per binding, before its weights.
        Raises BindRefused if the rollout refuses it (e.g. cannot load the workflow)."""
        stub = rollout_pb2_grpc.RolloutStub(self.channels.get(worker.address))
        await _bind(stub.BindExperiment, self._bind_request(), timeout)

    async def bind_reward(self, address: str, timeout: float) -> None:
        """Send a reward worker the experiment's spec: it loads the reward function now.
        Raises BindRefused if it cannot."""
        stub = reward_pb2_grpc.RewardStub(self.channels.get(address))
        await _bind(stub.BindExperiment, self._bind_request(), timeout)

    async def bind_rewards(
        self, addresses: list[str], timeout: float
    ) -> dict[str, BindRefused | grpc.aio.AioRpcError]:
        """`bind_reward` to every reward worker at once: the errors by address (any other
        exception is raised)."""
        results = await asyncio.gather(
            *(self.bind_reward(a, timeout) for a in addresses), return_exceptions=True
        )
        errors = {}
        for address, result in zip(addresses, results, strict=True):
            if isinstance(result, BindRefused | grpc.aio.AioRpcError):
                errors[address] = result
            elif isinstance(result, BaseException):
                raise result
        return errors

    def generate_groups(
        self, worker: Worker, requests: list[rollout_pb2.GenerateGroupRequest]
    ) -> AsyncIterator[rollout_pb2.GroupSummaries]:
        """One GenerateGroups call: the summaries as the groups finish. They started together,
        so the spec's `rollout.group_timeout_s` bounds the call."""
        stub = rollout_pb2_grpc.RolloutStub(self.channels.get(worker.address))
        request = rollout_pb2.GenerateGroupsRequest(groups=requests)
        return stub.GenerateGroups(request, timeout=self.spec.rollout.group_timeout_s)

    async def abort_groups(
        self, worker: Worker, group_ids: list[str], reason: str, timeout: float
    ) -> list[str]:
        """Ask `worker` to abort these groups unless they are being published; the ids it
        aborted (each is answered ABORTED)."""
        stub = rollout_pb2_grpc.RolloutStub(self.channels.get(worker.address))
        request = rollout_pb2.AbortGroupsRequest(
            experiment_id=self.experiment_id, group_ids=group_ids, reason=reason
        )
        return list((await stub.AbortGroups(request, timeout=timeout)).aborted)

    async def update_weights(
        self,
        worker: Worker,
        version: int,
        uri: str,
        timeout: float,
        fingerprint: str = "",
        group: tuple[int, int] = (0, 0),
        store: str = "",
    ) -> rollout_pb2.UpdateWeightsResponse:
        """`fingerprint`: the committed one ("" unknown); a rollout that serves `version` with
        other weights loads it again. `group`: the rollout's rank and the rollouts' count in
        the weight group of a `broadcast` experiment ((0, 0): it loads from `uri`), which meets
        on the store at `store` (host:port, as the trainer committed it; "" unknown)."""
        stub = rollout_pb2_grpc.RolloutStub(self.channels.get(worker.address))
        request = rollout_pb2.UpdateWeightsRequest(
            experiment_id=self.experiment_id,
            version=version,
            uri=uri,
            fingerprint=fingerprint,
            group_rank=group[0],
            group_size=group[1],
            broadcast_store=store,
        )
        return await stub.UpdateWeights(request, timeout=timeout)

    async def start_trainer(
        self, trainer: Worker, timeout: float
    ) -> trainer_pb2.StartExperimentResponse:
        stub = trainer_pb2_grpc.TrainerStub(self.channels.get(trainer.address))
        request = trainer_pb2.StartExperimentRequest(
            experiment_id=self.experiment_id, spec_json=self.spec_json
        )
        return await stub.StartExperiment(request, timeout=timeout)

    async def stop_trainer(self, trainer: Worker, timeout: float) -> None:
        stub = trainer_pb2_grpc.TrainerStub(self.channels.get(trainer.address))
        await stub.StopExperiment(
            trainer_pb2.StopExperimentRequest(experiment_id=self.experiment_id), timeout=timeout
        )
