"""The scheduler's test environment, shared by the scheduler's integration tests: a real
scheduler on port 0 against a real nats-server (`Cluster`), small rollout and trainer servicers
that implement the real proto services (`FakeRollout`, `FakeTrainer`: they return
GroupSummaries and versions and record what the scheduler asked), the spec and files of a small
experiment, and helpers that bring one to RUNNING.

Fixtures here are used by importing them into a test module (`cluster`, `files`)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json

import grpc
import pytest

from asyncrl.announcements import WeightsFollower
from asyncrl.grpcutil import channel
from asyncrl.natsutil import wait_until
from asyncrl.runtime import ServiceRuntime
from asyncrl.types import GroupId
from asyncrl.v1 import (
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from asyncrl.worker import WorkerAgent
from services.rollout.server import GroupCallError, GroupsServicer
from services.scheduler.server import create_scheduler


def attempt(group_id: str, k: int) -> str:
    """`group_id` as attempt `k` of the same prompt (the experiment id's random hex can hold
    "-a1" too: only the attempt changes)."""
    return str(dataclasses.replace(GroupId.parse(group_id), attempt=k))


ROLLOUT, REWARD, TRAINER = (
    common_pb2.WORKER_KIND_ROLLOUT,
    common_pb2.WORKER_KIND_REWARD,
    common_pb2.WORKER_KIND_TRAINER,
)
RUNNING = scheduler_pb2.EXPERIMENT_STATE_RUNNING
IDENTITY = {ROLLOUT: "rollout", REWARD: "reward", TRAINER: "trainer"}
"""The identity (token) each kind of worker calls the scheduler with."""


class FakeRollout(GroupsServicer):
    """Answers GenerateGroup with a fixed status; `hold` keeps training groups (and eval
    groups too with `hold_eval`) open until `release` is set; records requests, weight
    updates, cancelled calls and AbortGroups requests. A held group named by AbortGroups
    answers ABORTED, unless `published` (as if it were being published already)."""

    def __init__(
        self,
        hold: bool = False,
        rewards=(1.0, 0.0),
        fail_reason: str = "",
        published: bool = False,
        hold_eval: bool = False,
    ):
        self.hold = hold
        self.hold_eval = hold_eval
        self.rewards = list(rewards)
        self.fail_reason = fail_reason  # answer every training group FAILED with this reason
        self.release = asyncio.Event()
        self.requests: list[rollout_pb2.GenerateGroupRequest] = []
        self.updates: list[tuple[int, str]] = []
        self.update_requests: list[rollout_pb2.UpdateWeightsRequest] = []  # each, whole
        self.bound: list[str] = []  # specs of BindExperiment calls (JSON)
        self.version = 0
        self.served: list[int] = []  # the version loaded when each request came
        self.cancelled: list[str] = []
        self.fail_next = 0
        self.published = published
        self.abort_requests: list[list[str]] = []
        self.abort_reasons: list[str] = []
        self.follower: WeightsFollower | None = None
        self.via: list[str] = []  # how each update came: "rpc" or "announcement" (NATS)
        self.calls: list[list[str]] = []  # group ids of each GenerateGroups call
        self._aborts: dict[str, asyncio.Event] = {}

    async def BindExperiment(self, request, context):
        self.bound.append(request.spec_json)
        if self.follower is not None:  # the announcements of its weights (as the real one)
            await self.follower.follow(request.experiment_id)
        return common_pb2.BindExperimentResponse()

    async def _group(self, request):
        """One group; AbortGroups reaches it only while it runs (as a real rollout's)."""
        aborted = self._aborts[request.group_id] = asyncio.Event()
        try:
            return await self._run_group(request, aborted)
        finally:
            if self._aborts.get(request.group_id) is aborted:
                del self._aborts[request.group_id]

    async def _run_group(self, request, aborted: asyncio.Event):
        self.requests.append(request)
        self.served.append(self.version)
        if self.fail_next:
            self.fail_next -= 1
            raise GroupCallError(grpc.StatusCode.INTERNAL, "engine crashed")
        try:
            if self.hold and (self.hold_eval or not request.eval):
                wake = [asyncio.ensure_future(e.wait()) for e in (self.release, aborted)]
                try:
                    await asyncio.wait(wake, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in wake:
                        w.cancel()
        except asyncio.CancelledError:
            self.cancelled.append(request.group_id)
            raise
        if aborted.is_set():
            return rollout_pb2.GroupSummary(
                group_id=request.group_id, status=rollout_pb2.GROUP_STATUS_ABORTED
            )
        if self.fail_reason and not request.eval:
            return rollout_pb2.GroupSummary(
                group_id=request.group_id,
                status=rollout_pb2.GROUP_STATUS_FAILED,
                reason=self.fail_reason,
            )
        return rollout_pb2.GroupSummary(
            group_id=request.group_id,
            status=rollout_pb2.GROUP_STATUS_ACCEPTED,
            rewards=self.rewards,
            tokens=10,
            start_version=self.version,
            end_version=self.version,
            published=True,
        )

    async def GenerateGroups(self, request, context):
        self.calls.append([g.group_id for g in request.groups])
        async for summaries in super().GenerateGroups(request, context):
            yield summaries

    async def AbortGroups(self, request, context):
        self.abort_requests.append(list(request.group_ids))
        self.abort_reasons.append(request.reason)
        if self.published:
            return rollout_pb2.AbortGroupsResponse()
        held = [g for g in request.group_ids if g in self._aborts]
        for g in held:
            self._aborts[g].set()
        return rollout_pb2.AbortGroupsResponse(aborted=held)

    async def UpdateWeights(self, request, context):
        self.via.append("announcement" if context is None else "rpc")
        self.updates.append((request.version, request.uri))
        self.update_requests.append(request)
        self.version = request.version
        return rollout_pb2.UpdateWeightsResponse(version=request.version)

    def group_ids(self) -> list[str]:
        return [r.group_id for r in self.requests if not r.eval]


class FakeTrainer(trainer_pb2_grpc.TrainerServicer):
    """Reports `waiting` on the experiment it was started with; `failure` (if set) puts it in
    `failed` with that message, also after every later StartExperiment."""

    def __init__(self, version: int = 0):
        self.version = version
        self.uri = f"file:///w/v{version}" if version else ""
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.experiment_id = ""
        self.state = "idle"
        self.failure = ""

    def fail(self, message: str) -> None:
        self.failure = message
        self.state = "failed"

    async def StartExperiment(self, request, context):
        self.started.append(request.experiment_id)
        self.experiment_id = request.experiment_id
        self.state = "failed" if self.failure else "waiting"
        return trainer_pb2.StartExperimentResponse(
            version=self.version, resumed=self.version > 0, uri=self.uri
        )

    async def StopExperiment(self, request, context):
        self.stopped.append(request.experiment_id)
        return trainer_pb2.StopExperimentResponse()

    async def GetStatus(self, request, context):
        return trainer_pb2.TrainerStatus(
            experiment_id=self.experiment_id, state=self.state, message=self.failure
        )


class Cluster:
    """The scheduler plus the fake workers a test starts; stops everything at the end."""

    def __init__(self, nats_url: str):
        self.nats_url = nats_url
        self.scheduler = None
        self.runtime = None
        self.address = ""
        self._closers = []

    async def start_scheduler(self, **kw):
        kw.setdefault("lease_ttl_s", 3.0)
        kw.setdefault("heartbeat_interval_s", 0.2)
        self.runtime, self.scheduler = await create_scheduler(self.nats_url, grace_s=0, **kw)
        self.port = self.runtime.port
        self.address = f"127.0.0.1:{self.port}"
        self.stub = self.stub_as("admin")
        self.trainer_stub = self.stub_as("trainer")  # the fake trainers' identity
        return self.scheduler

    def stub_as(self, identity: str) -> scheduler_pb2_grpc.SchedulerStub:
        """A stub calling the scheduler with `identity`'s token."""
        ch = channel(self.address, identity)
        self._closers.append(ch.close)
        return scheduler_pb2_grpc.SchedulerStub(ch)

    async def stop_scheduler(self):
        await self.runtime.close()

    async def worker(self, kind, servicer=None, capacity=8, port=0):
        """Serve `servicer` (if any) on `port` (0: a free one) and register it with a
        heartbeating agent."""
        server = None
        if isinstance(servicer, FakeRollout):
            server = ServiceRuntime("fake-rollout", grace_s=0)
            port = await server.serve(
                [(rollout_pb2_grpc.add_RolloutServicer_to_server, servicer)],
                ["asyncrl.v1.Rollout"],
                port=port,
            )
        elif isinstance(servicer, FakeTrainer):
            server = ServiceRuntime("fake-trainer", grace_s=0)
            port = await server.serve(
                [(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer)],
                ["asyncrl.v1.Trainer"],
                port=port,
            )
        agent = WorkerAgent(
            kind,
            f"127.0.0.1:{port}" if server else f"127.0.0.1:{kind}0",
            capacity=capacity,
            scheduler=self.address,
            identity=IDENTITY[kind],
            nats_url=self.nats_url,
        )
        if isinstance(servicer, FakeRollout):
            servicer.follower = WeightsFollower(agent, servicer.UpdateWeights)
        await agent.start()

        async def close():
            if isinstance(servicer, FakeRollout):
                await servicer.follower.close()
            await agent.stop()
            if server is not None:
                await server.close()

        self._closers.append(close)
        return agent, close

    async def close(self):
        for fn in reversed(self._closers):
            await fn()
        if self.runtime is not None:
            await self.runtime.close()

    async def experiment(self, exp_id):
        return await self.stub.GetExperiment(
            scheduler_pb2.GetExperimentRequest(experiment_id=exp_id), timeout=5
        )

    async def commit(self, exp_id, version, groups=2, **fields):
        """CommitWeights as the fake trainers' identity (`fields`: more of the request's)."""
        return await self.trainer_stub.CommitWeights(
            scheduler_pb2.CommitWeightsRequest(
                experiment_id=exp_id,
                version=version,
                uri=f"file:///w/v{version}",
                metrics=common_pb2.StepMetrics(step=version, version=version, groups=groups),
                **fields,
            ),
            timeout=10,
        )


CLOSE_S = 60
"""How long the scheduler and the fake workers may take to close at a test's end."""


async def close_or_tell(c: Cluster) -> None:
    """Close `c`; a close that hangs fails the test at CLOSE_S with every task's stack (one
    hung once for the whole 600 s test timeout, inside the scheduler's shutdown, and said
    nothing about where)."""
    closing = asyncio.ensure_future(c.close())
    done, _ = await asyncio.wait({closing}, timeout=CLOSE_S)
    if not done:  # the stacks as they hang, then give up on it
        stacks = io.StringIO()
        for task in asyncio.all_tasks():
            task.print_stack(limit=12, file=stacks)
        closing.cancel()
        pytest.fail(f"closing the cluster took over {CLOSE_S} s; tasks:\n{stacks.getvalue()}")
    await closing


@pytest.fixture
async def cluster(nats_server):
    c = Cluster(nats_server.url)
    yield c
    await close_or_tell(c)


@pytest.fixture
def files(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20))
    )
    evals = tmp_path / "eval.jsonl"
    evals.write_text(
        "".join(json.dumps({"prompt": f"{i}+2=", "answer": str(i + 2)}) + "\n" for i in range(3))
    )
    return {"model": str(model), "data": str(data), "eval": str(evals)}


def spec(files, **sections):
    data = {
        "name": "Math RL #1",
        "model": {"path": files["model"]},
        "dataset": {"path": files["data"], "shuffle": False},
        "rollout": {"n_samples": 2, "max_head_offpolicyness": 0, "filter": "none"},
        "reward": {"function": "exact_match"},
        "trainer": {"batch_size": 2, "total_steps": 3, "backend": "torch"},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return json.dumps(data)


async def submit(cluster, spec_json: str) -> str:
    exp = await cluster.stub.SubmitExperiment(
        scheduler_pb2.SubmitExperimentRequest(spec_json=spec_json), timeout=10
    )
    return exp.id


async def running_experiment(
    cluster, files, fake_rollout: FakeRollout, fake_trainer=None, **sections
):
    exp_id = await started_experiment(cluster, files, fake_rollout, fake_trainer, **sections)
    await wait_until(lambda: cluster.scheduler.get(exp_id).state.value == "RUNNING", 10)
    return exp_id


async def started_experiment(
    cluster, files, fake_rollout: FakeRollout, fake_trainer=None, **sections
):
    """Workers registered and the experiment submitted (it may end before it is seen RUNNING)."""
    await cluster.worker(REWARD)
    await cluster.worker(TRAINER, fake_trainer or FakeTrainer())
    await cluster.worker(ROLLOUT, fake_rollout)
    return await submit(cluster, spec(files, **sections))
