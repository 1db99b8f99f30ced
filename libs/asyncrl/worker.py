"""Worker side of the registry: register with the scheduler, heartbeat, re-register when the
scheduler forgot us (e.g. it restarted). Used by rollout, reward and trainer services."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import grpc

from asyncrl.grpcutil import channel
from asyncrl.logging import get_logger, keep_running
from asyncrl.retry import connect_policy, idempotent_rpc
from asyncrl.settings import settings
from asyncrl.v1 import scheduler_pb2, scheduler_pb2_grpc

log = get_logger()

SCHEDULER_CHANNEL = {"grpc.max_reconnect_backoff_ms": 250}
"""A worker looks for a scheduler that went away (a hand-over, a restart) every 0.1-0.25 s, not
up to every 1 s: it registers with the successor within 0.25 s of its bind (the run waits for
every kind of worker to be back; 0.3-0.7 s after the bind with 1 s on the loaded machine)."""


class WorkerAgent:
    """Keeps one worker registered. `load` reports current load on each heartbeat."""

    def __init__(
        self,
        kind: int,
        address: str,
        name: str | None = None,
        capacity: int = 1,
        scheduler: str | None = None,
        load=lambda: 0,
        identity: str | None = None,
        on_beat: Callable[[scheduler_pb2.HeartbeatResponse], None] | None = None,
        device: str = "",
    ):
        self.kind = kind
        self.address = address
        self.name = name or f"{socket.gethostname()}:{address.rsplit(':', 1)[-1]}"
        self.capacity = capacity
        self.device = device
        """Where it computes, as `asyncrl workers` shows it ("cpu", "cuda:0 = GPU 4 (...)")."""
        self.scheduler = scheduler or settings().scheduler
        self.load = load
        self.on_beat = on_beat
        """Called with each heartbeat's answer (a rollout takes the reward addresses)."""
        self.worker_id: str | None = None
        self.interval = 1.0
        self._task: asyncio.Task | None = None
        self._channel = channel(self.scheduler, identity, options=SCHEDULER_CHANNEL)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    async def register(self) -> str:
        req = scheduler_pb2.RegisterWorkerRequest(
            kind=self.kind,
            address=self.address,
            name=self.name,
            capacity=self.capacity,
            device=self.device,
        )
        async for attempt in connect_policy(max_delay_s=120):
            with attempt:
                # waits for the connection (a scheduler restarting: registered as it binds)
                resp = await self._stub.RegisterWorker(req, timeout=5, wait_for_ready=True)
        self.worker_id = resp.worker_id
        self.interval = resp.heartbeat_interval_s or 1.0
        log.info(
            "worker_registered",
            worker=self.worker_id,
            address=self.address,
            scheduler=self.scheduler,
        )
        return self.worker_id

    async def _beat_forever(self) -> None:
        await keep_running("heartbeat", self._beat, log, retry_s=self.interval)

    async def _beat(self) -> None:
        """One heartbeat after `interval`; registers again when the scheduler forgot this
        worker or did not answer. The call waits for the connection (`wait_for_ready`, up to
        three intervals): a scheduler replaced on a hand-over is reached the moment its
        successor binds (gRPC's reconnect backoff, 0.1-1 s), which answers `known: false`, and
        the worker registers at once; without it a refused attempt slept its retry backoff
        (0.1-1.1 s) first and the run waited for that."""
        await asyncio.sleep(self.interval)
        try:
            async for attempt in idempotent_rpc(attempts=3, max_delay_s=self.interval * 3):
                with attempt:
                    resp = await self._stub.Heartbeat(
                        scheduler_pb2.HeartbeatRequest(
                            worker_id=self.worker_id, load=int(self.load())
                        ),
                        timeout=max(1.0, self.interval) * 3,
                        wait_for_ready=True,
                    )
            if self.on_beat is not None:
                self.on_beat(resp)
            if not resp.known:
                log.warning("worker_unknown_reregistering", worker=self.worker_id)
                await self.register()
        except grpc.aio.AioRpcError as e:
            log.warning("heartbeat_failed", code=str(e.code()), details=e.details())
            try:
                await self.register()
            except grpc.aio.AioRpcError:
                pass

    async def start(self) -> str:
        wid = await self.register()
        self._task = asyncio.create_task(self._beat_forever())
        return wid

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        await self._channel.close()

    async def leave(self, timeout_s: float = 1.0) -> None:
        """Stop heartbeating and tell the scheduler this worker is going (a stopping service,
        before it drains): it hands out neither new work nor this address from now on. A
        scheduler that does not answer within `timeout_s` lets the lease lapse instead."""
        if self._task:
            self._task.cancel()
        if self.worker_id:
            request = scheduler_pb2.HeartbeatRequest(worker_id=self.worker_id, leaving=True)
            try:
                await self._stub.Heartbeat(request, timeout=timeout_s)
                log.info("worker_left", worker=self.worker_id, address=self.address)
            except grpc.aio.AioRpcError as e:
                log.warning("worker_leave_failed", worker=self.worker_id, code=e.code().name)
        await self._channel.close()
