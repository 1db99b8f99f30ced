"""The calls an experiment runner makes to its workers, each with a deadline: BindExperiment
(the spec, once per binding, to rollouts and reward workers), GenerateGroups calls,
UpdateWeights (and the set of rollouts that serve the fleet version), and the trainer's
StartExperiment / StopExperiment."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from asyncrl.spec import ExperimentSpec, RolloutSpec, spec_to_json
from asyncrl.types import StepMetrics
from asyncrl.v1 import (
    common_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from services.scheduler.context import ChannelPool
from services.scheduler.dataset import Prompt, Ticket
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
        self, worker: Worker, version: int, uri: str, timeout: float
    ) -> rollout_pb2.UpdateWeightsResponse:
        stub = rollout_pb2_grpc.RolloutStub(self.channels.get(worker.address))
        request = rollout_pb2.UpdateWeightsRequest(
            experiment_id=self.experiment_id, version=version, uri=uri
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


FLEET_LAG_MAX = 1
"""How many versions the fleet may serve behind the trainer's newest commit: CommitWeights(v)
is answered once the fleet serves v - lag, lag = min(FLEET_LAG_MAX, eta - 1) (`fleet_lag`). At
lag 1 it is answered at once (unless the fleet's update to the previous version is still under
way): the trainer trains on while the fleet loads the version it just committed. The trainer
then consumes groups up to one version staler than when the fleet keeps up, so the lag comes
out of eta: at eta <= 1 it is 0 (answered once the fleet serves v; the trainer still trains its
next step meanwhile, but what it consumes stays as fresh as before)."""


def fleet_lag(rollout: RolloutSpec) -> int:
    """Versions the fleet may serve behind the trainer's newest commit (see FLEET_LAG_MAX)."""
    return max(0, min(FLEET_LAG_MAX, rollout.max_head_offpolicyness - 1))


@dataclass
class FleetUpdate:
    """One update of the ready rollouts to `version` (what `FleetWeights.broadcast` did)."""

    version: int
    seconds: float = 0.0
    """UpdateWeights to every ready rollout, in parallel."""
    updated: int = 0
    failed: list[tuple[Worker, str]] = field(default_factory=list)
    """The rollouts that failed or lagged past the deadline, with the reason."""
    slowest: rollout_pb2.UpdateWeightsResponse | None = None
    """The answer of the rollout that took longest: where its time went."""
    previous: int = 0
    """The fleet version before (versions in between were coalesced)."""
    lag_s: float = 0.0
    """From the version's commit until the fleet served it."""

    def phases(self) -> dict[str, float]:
        """The slowest rollout's phases, seconds by name (zeros when none answered)."""
        s = self.slowest or rollout_pb2.UpdateWeightsResponse()
        return {"read": s.read_s, "pause": s.pause_s, "load": s.load_s, "resume": s.resume_s}


class FleetWeights:
    """Which bound rollouts serve the fleet version, and where the fleet is being taken (the
    trainer's newest commit). `lock` is held across a fleet update (broadcast then version
    change), so a rollout being synced sees an update fully done or not started."""

    def __init__(self, calls: WorkerCalls, version: int, uri: str):
        self.calls = calls
        self.version = version
        """The fleet version: the weights the ready rollouts serve (admission uses it)."""
        self.uri = uri
        self.ready: set[str] = set()
        self.lock = asyncio.Lock()
        self.target: tuple[int, str] = (version, uri)
        """The trainer's newest committed (version, uri): where the fleet is being taken."""
        self.target_at = time.monotonic()
        self.task: asyncio.Task | None = None
        """The update under way (one at a time)."""
        self.last: FleetUpdate | None = None
        """The newest update done (reported with the next step's metrics)."""
        self.commit_s = 0.0
        """The last commit's bookkeeping time (reported with the next step's metrics)."""
        self._moved = asyncio.Event()

    def set_target(self, version: int, uri: str) -> None:
        self.target, self.target_at = (version, uri), time.monotonic()
        self.notify()

    def notify(self) -> None:
        """The fleet version, the target or the run changed: wake whoever waits in `moved`."""
        self._moved.set()
        self._moved = asyncio.Event()

    async def moved(self) -> None:
        """Return at the next `notify`."""
        await self._moved.wait()

    def into_metrics(self, metrics: StepMetrics) -> None:
        """The newest update and the last commit's bookkeeping, into a step's metrics."""
        metrics.scheduler_s = self.commit_s
        update = self.last
        if update is None:
            return
        phases = update.phases()
        metrics.fleet_version = update.version
        metrics.fleet_update_s, metrics.fleet_lag_s = update.seconds, update.lag_s
        metrics.rollout_read_s, metrics.rollout_pause_s = phases["read"], phases["pause"]
        metrics.rollout_load_s, metrics.rollout_resume_s = phases["load"], phases["resume"]

    async def sync(
        self, worker: Worker, still_bound: Callable[[], bool], timeout: float
    ) -> int | None:
        """Load the fleet's weights into `worker` (again if a commit lands meanwhile); returns
        the version, or None if it was unbound meanwhile. Raises BindRefused if the worker
        refuses the experiment, AioRpcError on any other failure."""
        await self.calls.bind(worker, timeout)
        while True:
            version, uri = self.version, self.uri
            await self.calls.update_weights(worker, version, uri, timeout)
            async with self.lock:
                if not still_bound():
                    return None
                if version == self.version:
                    worker.version = version
                    self.ready.add(worker.worker_id)
                    return version

    async def broadcast(self, workers: list[Worker], version: int, uri: str) -> FleetUpdate:
        """UpdateWeights to all `workers` in parallel (call with `lock` held); the update names
        the ones that failed or lagged past the spec's `rollout.weight_update_timeout_s`, with
        the reason. That deadline, not a frozen worker's lease, bounds how long it waits."""
        timeout = self.calls.spec.rollout.weight_update_timeout_s
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(self.calls.update_weights(w, version, uri, timeout) for w in workers),
            return_exceptions=True,
        )
        update = FleetUpdate(version, seconds=time.perf_counter() - t0)
        for w, result in zip(workers, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError):
                update.failed.append((w, result.code().name))
            elif isinstance(result, BaseException):
                update.failed.append((w, type(result).__name__))
            else:
                w.version = version
                update.updated += 1
                if update.slowest is None or result.seconds > update.slowest.seconds:
                    update.slowest = result
        return update
