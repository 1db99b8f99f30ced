"""The trainer's test environment, shared by the trainer's integration tests: a recording
Scheduler servicer on a real gRPC server, a trainer factory fixture (real trainer gRPC server,
real nats-server), the spec and a trajectory group of the tiny model with base-model logprobs.

Fixtures here are used by importing them into a test module (`scheduler`, `start_trainer`)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest
import torch

from asyncrl.grpcutil import channel
from asyncrl.ledger import ensure_ledger
from asyncrl.natsutil import (
    STREAM,
    wait_until,
)
from asyncrl.runtime import ServiceRuntime
from asyncrl.spec import (
    DatasetSpec,
    ExperimentSpec,
    ModelSpec,
    RolloutSpec,
    TrainerSpec,
    spec_to_json,
)
from asyncrl.types import RewardStatus, Sample, TrajectoryGroup
from asyncrl.v1 import scheduler_pb2, scheduler_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.trainer.algo import token_logprobs
from services.trainer.consumer import durable_name
from services.trainer.server import create_trainer

EXP = "exp-trainer"


class RecordingScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Registers workers and records CommitWeights / ReportDropped; says stop from a version."""

    def __init__(self):
        self.commits: list[scheduler_pb2.CommitWeightsRequest] = []
        self.dropped: list[scheduler_pb2.DroppedGroup] = []
        self.workers: list[scheduler_pb2.RegisterWorkerRequest] = []
        self.stop_at_version: int | None = None
        self.heartbeats = 0
        self.commit_error: tuple[grpc.StatusCode, str] | None = None

    async def RegisterWorker(self, request, context):
        self.workers.append(request)
        return scheduler_pb2.RegisterWorkerResponse(
            worker_id=f"trainer-{len(self.workers)}", lease_ttl_s=10, heartbeat_interval_s=1
        )

    async def Heartbeat(self, request, context):
        self.heartbeats += 1
        return scheduler_pb2.HeartbeatResponse(known=True)

    async def CommitWeights(self, request, context):
        if self.commit_error is not None:
            await context.abort(*self.commit_error)
        self.commits.append(request)
        stop = self.stop_at_version is not None and request.version >= self.stop_at_version
        return scheduler_pb2.CommitWeightsResponse(fleet_version=request.version, stop=stop)

    async def ReportDropped(self, request, context):
        self.dropped.extend(request.groups)
        return scheduler_pb2.ReportDroppedResponse()


@pytest.fixture
async def scheduler(js):
    """The recording scheduler, serving; like the real one it creates the ledger stream (the
    trainer's NATS user may append to it but not create it)."""
    await ensure_ledger(js)
    async with serving(RecordingScheduler()) as servicer:
        yield servicer


@contextlib.asynccontextmanager
async def serving(servicer: RecordingScheduler):
    """`servicer` as a Scheduler gRPC server on a free port; its `address` is set."""
    runtime = ServiceRuntime("fake-scheduler", grace_s=0)
    port = await runtime.serve(
        [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer)], ["asyncrl.v1.Scheduler"]
    )
    servicer.address = f"127.0.0.1:{port}"
    try:
        yield servicer
    finally:
        await runtime.close()


@pytest.fixture
async def start_trainer(nats_server, scheduler, tmp_path):
    """Factory: a trainer gRPC server + a stub to it, sharing var and weight dirs per test."""
    started = []

    async def start():
        runtime, service = await create_trainer(
            nats_server.url,
            scheduler=scheduler.address,
            var_dir=tmp_path / "var",
            weights_dir=tmp_path / "weights",
        )
        ch = channel(f"127.0.0.1:{runtime.port}", "scheduler")
        started.append((runtime, service, ch))
        return service, trainer_pb2_grpc.TrainerStub(ch)

    yield start
    for runtime, service, ch in started:
        await ch.close()
        await service.close(checkpoint=False)  # as a crash leaves it: no final checkpoint
        await runtime.close()


def _spec(
    model_dir: Path, eta: int = 0, batch_size: int = 2, checkpoint_every: int = 1, **trainer
) -> str:
    return spec_to_json(
        ExperimentSpec(
            model=ModelSpec(path=str(model_dir)),
            dataset=DatasetSpec(path="unused-by-the-trainer.jsonl"),
            rollout=RolloutSpec(n_samples=2, max_head_offpolicyness=eta),
            trainer=TrainerSpec(
                # no rollouts here to meet a broadcast: versions go through the store
                **{"backend": "torch", "lr": 1e-3, "weight_sync": "disk"}
                | trainer
                | {"batch_size": batch_size, "checkpoint_every": checkpoint_every}
            ),
        )
    )


def _group(tiny, gid: str, start_version: int, completions=("4", "5x")) -> TrajectoryGroup:
    """A group whose behaviour logprobs come from the base model; rewards 1 and 0."""
    _, model, tok = tiny
    prompt_ids = tok("2+2=")["input_ids"]
    samples = []
    for i, text in enumerate(completions):
        out = tok(text)["input_ids"]
        ids = torch.tensor([prompt_ids + out])
        with torch.no_grad():
            lp = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0]
        samples.append(
            Sample(
                output_ids=out,
                logprobs=lp[len(prompt_ids) - 1 :].tolist(),
                versions=[start_version] * len(out),
                reward=1.0 - i,
                reward_status=RewardStatus.OK,
                text=text,
            )
        )
    return TrajectoryGroup(
        experiment_id=EXP,
        group_id=gid,
        prompt_id="p-" + gid,
        prompt="2+2=",
        answer="4",
        prompt_ids=prompt_ids,
        samples=samples,
        start_version=start_version,
    )


async def _status(stub) -> trainer_pb2.TrainerStatus:
    return await stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=5)


async def _wait_commits(scheduler, n: int, timeout: float = 30.0) -> None:
    await wait_until(lambda: len(scheduler.commits) >= n, timeout=timeout)


async def _wait_acked(js, stream_seq: int, timeout: float = 30.0):
    """The trainer's consumer once it has taken (and acked) every message up to `stream_seq`;
    the trainer acks a group as it takes it into a batch or drops it."""
    async with asyncio.timeout(timeout):
        while True:
            info = await js.consumer_info(STREAM, durable_name(EXP))
            if info.ack_floor.stream_seq >= stream_seq:
                return info
            await asyncio.sleep(0.05)  # poll the consumer's state
