"""Python SDK: an asyncio client for the scheduler's experiment and worker API.

    async with AsyncrlClient("127.0.0.1:50051") as client:
        exp = await client.submit({"model": {"path": ...}, "dataset": {"path": ...}})
        async for event in client.watch(exp.id):
            ...

Every call has a deadline. Idempotent calls (get, list, workers) retry transient errors through
`asyncrl.retry.idempotent_rpc`; submit and cancel never retry. A failed call raises
`AsyncrlError` carrying the gRPC status code and details. `read_groups` reads an experiment's
trajectory groups back from JetStream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc

from asyncrl import natsutil
from asyncrl.convert import group_from_bytes
from asyncrl.grpcutil import channel
from asyncrl.retry import RETRYABLE_CODES, idempotent_rpc
from asyncrl.settings import settings
from asyncrl.spec import ExperimentSpec, spec_from_json
from asyncrl.types import TrajectoryGroup
from asyncrl.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

CONNECT_TIMEOUT_S = 3.0
"""How long a call that is not retried waits for its connection (gRPC's reconnect backoff
starts at 1 s, so a handshake that fails once is tried again within it)."""
CANCEL_TIMEOUT_S = 60.0
"""Cancel's deadline: the scheduler stops the trainer (up to 10 s) before it answers."""
RESUME_TIMEOUT_S = 60.0
"""Resume's deadline: the scheduler reads the dataset again before it answers."""
CHECKPOINT_TIMEOUT_S = 300.0
"""Checkpoint's deadline: the trainer saves at its next step boundary (model and optimizer)."""

TERMINAL_STATES = frozenset(
    {
        scheduler_pb2.EXPERIMENT_STATE_COMPLETED,
        scheduler_pb2.EXPERIMENT_STATE_FAILED,
        scheduler_pb2.EXPERIMENT_STATE_CANCELLED,
    }
)


def experiment_spec(exp: scheduler_pb2.Experiment) -> ExperimentSpec:
    """The validated spec an Experiment message carries (as JSON)."""
    return spec_from_json(exp.spec_json)


def default_address() -> str:
    return settings().scheduler


def state_name(state: int) -> str:
    """`EXPERIMENT_STATE_RUNNING` -> `RUNNING`."""
    return scheduler_pb2.ExperimentState.Name(state).removeprefix("EXPERIMENT_STATE_")


def is_terminal(experiment: scheduler_pb2.Experiment) -> bool:
    return experiment.state in TERMINAL_STATES


class AsyncrlError(Exception):
    """A scheduler call failed. `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, err: grpc.aio.AioRpcError) -> AsyncrlError:
        return cls(err.code(), err.details() or "")


class AsyncrlClient:
    """Client for one scheduler. Use as `async with`, or call `close()` when done."""

    def __init__(
        self,
        address: str | None = None,
        timeout_s: float = 10.0,
        watch_stream_timeout_s: float = 300.0,
    ):
        self.address = address or default_address()
        self.timeout_s = timeout_s
        self.watch_stream_timeout_s = watch_stream_timeout_s
        self._channel = channel(self.address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    async def __aenter__(self) -> AsyncrlClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _once(self, method, request, timeout_s: float | None = None, to=None):
        """A call that is not retried (not idempotent) is sent once the channel is up (`to`:
        (channel, address), the scheduler's by default): a refused or broken handshake is
        tried again for CONNECT_TIMEOUT_S instead of failing the call, and the request is
        never sent twice."""
        to_channel, address = to or (self._channel, self.address)
        try:
            await asyncio.wait_for(to_channel.channel_ready(), CONNECT_TIMEOUT_S)
        except TimeoutError:
            raise AsyncrlError(
                grpc.StatusCode.UNAVAILABLE,
                f"no connection to {address} within {CONNECT_TIMEOUT_S:g} s",
            ) from None
        try:
            return await method(request, timeout=timeout_s or self.timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise AsyncrlError.from_rpc(e) from None

    async def _idempotent(self, method, request):
        try:
            async for attempt in idempotent_rpc(attempts=4, max_delay_s=3 * self.timeout_s):
                with attempt:
                    return await method(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise AsyncrlError.from_rpc(e) from None

    async def submit(self, spec: dict | ExperimentSpec) -> scheduler_pb2.Experiment:
        """Submit a spec (a YAML-shaped dict, or a validated ExperimentSpec); the scheduler
        validates it (INVALID_ARGUMENT names the bad field). Not retried: not idempotent."""
        if isinstance(spec, ExperimentSpec):
            spec = spec.model_dump()
        request = scheduler_pb2.SubmitExperimentRequest(spec_json=json.dumps(spec))
        return await self._once(self._stub.SubmitExperiment, request)

    async def get(self, experiment_id: str, with_history: bool = False) -> scheduler_pb2.Experiment:
        return await self._idempotent(
            self._stub.GetExperiment,
            scheduler_pb2.GetExperimentRequest(
                experiment_id=experiment_id, with_history=with_history
            ),
        )

    async def list(self) -> list[scheduler_pb2.Experiment]:
        resp = await self._idempotent(
            self._stub.ListExperiments, scheduler_pb2.ListExperimentsRequest()
        )
        return list(resp.experiments)

    async def cancel(self, experiment_id: str) -> scheduler_pb2.Experiment:
        """Answers once the experiment's trainer has stopped (the scheduler waits up to its
        `trainer_stop_timeout_s`, 10 s, for it), so its deadline is longer than the others'."""
        return await self._once(
            self._stub.CancelExperiment,
            scheduler_pb2.CancelExperimentRequest(experiment_id=experiment_id),
            timeout_s=max(self.timeout_s, CANCEL_TIMEOUT_S),
        )

    async def resume(self, experiment_id: str) -> scheduler_pb2.Experiment:
        """Continue a CANCELLED or FAILED experiment from its trainer's last checkpoint, with
        the same ledger (FAILED_PRECONDITION names any other state). Not retried: a second
        resume of a resumed run is refused."""
        return await self._once(
            self._stub.ResumeExperiment,
            scheduler_pb2.ResumeExperimentRequest(experiment_id=experiment_id),
            timeout_s=max(self.timeout_s, RESUME_TIMEOUT_S),
        )

    async def checkpoint(
        self, experiment_id: str, timeout_s: float = CHECKPOINT_TIMEOUT_S
    ) -> trainer_pb2.CheckpointNowResponse:
        """Have the experiment's trainer checkpoint now (at its next step boundary): the
        trainer bound to it (from ListWorkers) gets `CheckpointNow`; its answer has the path and
        the step. FAILED_PRECONDITION when no trainer runs the experiment."""
        trainers = [
            w
            for w in await self.workers()
            if w.kind == common_pb2.WORKER_KIND_TRAINER and w.experiment_id == experiment_id
        ]
        if not trainers:
            await self.get(experiment_id)  # NOT_FOUND for an unknown id
            raise AsyncrlError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"experiment_id: no trainer runs {experiment_id} now",
            )
        trainer_channel = channel(trainers[0].address)
        try:
            stub = trainer_pb2_grpc.TrainerStub(trainer_channel)
            request = trainer_pb2.CheckpointNowRequest(experiment_id=experiment_id)
            to = (trainer_channel, trainers[0].address)
            return await self._once(stub.CheckpointNow, request, timeout_s, to=to)
        finally:
            await trainer_channel.close()

    async def workers(self) -> list[scheduler_pb2.WorkerInfo]:
        resp = await self._idempotent(self._stub.ListWorkers, scheduler_pb2.ListWorkersRequest())
        return list(resp.workers)

    async def watch(self, experiment_id: str) -> AsyncIterator[scheduler_pb2.ProgressEvent]:
        """Progress events until the experiment is terminal.

        Each stream has a deadline (`watch_stream_timeout_s`); when it expires or the scheduler
        restarts, the watch reconnects (the server starts every stream with a snapshot), so a
        watch may last as long as the run.
        """
        request = scheduler_pb2.WatchExperimentRequest(experiment_id=experiment_id)
        while True:
            terminal = False
            try:
                stream = self._stub.WatchExperiment(request, timeout=self.watch_stream_timeout_s)
                async for event in stream:
                    yield event
                    if event.HasField("experiment") and is_terminal(event.experiment):
                        terminal = True
                        stream.cancel()
                        break
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRYABLE_CODES:
                    raise AsyncrlError.from_rpc(e) from None
            if terminal:
                return
            # The stream ended or broke without a terminal state: ask once, then re-watch.
            exp = await self.get(experiment_id)
            if is_terminal(exp):
                yield scheduler_pb2.ProgressEvent(kind="state", experiment=exp)
                return
            await asyncio.sleep(0.5)


async def read_groups(
    experiment_id: str,
    nats_url: str | None = None,
    include_eval: bool = False,
    limit: int | None = None,
    timeout_s: float = 10.0,
) -> AsyncIterator[TrajectoryGroup]:
    """The experiment's trajectory groups from JetStream, oldest first, until caught up.

    Reads message by message (one STREAM.MSG.GET each, no consumer: readers may not create
    consumers, see natsutil.NATS_PERMISSIONS); a tenant's user through its own consumer, its
    own experiments only (asyncrl.nats_tenants). Eval groups are skipped unless `include_eval`;
    `limit` caps how many groups are yielded.
    """

    async def quiet(exc: Exception) -> None:  # connection errors surface as the raised error
        pass

    nc = await natsutil.connect(
        nats_url,
        connect_timeout=timeout_s,
        max_reconnect_attempts=2,
        error_cb=quiet,
    )
    try:
        js = nc.jetstream(timeout=timeout_s)
        subject = natsutil.experiment_subjects(experiment_id)
        yielded = 0
        async for msg in natsutil.iter_stored(js, natsutil.STREAM, subject):
            if limit is not None and yielded >= limit:
                break
            group = group_from_bytes(msg.data)
            if include_eval or not group.eval:
                yielded += 1
                yield group
    finally:
        await nc.close()


def group_record(group: TrajectoryGroup) -> dict:
    """One JSON-ready line of `asyncrl dump`."""
    return {
        "group_id": group.group_id,
        "prompt_id": group.prompt_id,
        "prompt": group.prompt,
        "prompt_ids": group.prompt_ids,  # what the model saw (chat-templated, if so set)
        "answer": group.answer,
        "start_version": group.start_version,
        "eval": group.eval,
        "epoch": group.epoch,
        "samples": [
            {
                "text": s.text,
                "reward": s.reward,
                "reward_status": s.reward_status.value,
                "reward_reason": s.reward_reason,
                "finish_reason": s.finish_reason,
                "versions": s.versions,
                "output_ids": s.output_ids,
                "logprobs": s.logprobs,
                "loss_mask": s.trained_mask(),  # 0 = environment token (multi-turn workflows)
            }
            for s in group.samples
        ],
    }
