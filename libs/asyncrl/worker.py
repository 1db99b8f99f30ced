"""Worker side of the registry: register with the scheduler, heartbeat, re-register when the
scheduler forgot us (e.g. it restarted). Used by rollout, reward and trainer services.

Heartbeats go on NATS (asyncrl.liveness): one publish per interval, no answer awaited; the
scheduler answers only a beat of a worker it does not know (register again). The process's
`incarnation` (random, made once) goes with every registration and beat: registering again
after a hiccup is never taken for a restart. The Heartbeat RPC remains for a scheduler that
names no heartbeat subject (an older one), while NATS cannot be reached, and to leave."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from collections.abc import Callable

import grpc

from asyncrl.grpcutil import channel
from asyncrl.liveness import REWARDS_SUBJECT, SCHEDULER_SUBJECT, UNKNOWN, Beat
from asyncrl.logging import get_logger, keep_running
from asyncrl.retry import connect_policy, idempotent_rpc
from asyncrl.settings import settings
from asyncrl.v1 import scheduler_pb2, scheduler_pb2_grpc

log = get_logger()

SCHEDULER_CHANNEL = {"grpc.max_reconnect_backoff_ms": 250}
"""A worker looks for a scheduler that went away (a hand-over, a restart) every 0.1-0.25 s, not
up to every 1 s: it registers with the successor within 0.25 s of its bind (the run waits for
every kind of worker to be back; 0.3-0.7 s after the bind with 1 s on the loaded machine)."""
NATS_WAIT_S = 5.0
"""How long a worker without a NATS connection of its service's tries to connect at start;
after that it heartbeats with the RPC for its life."""


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
        nc=None,
        nats_url: str | None = None,
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
        """Called with the reward workers' addresses as the scheduler sends them (a rollout
        takes them; the Heartbeat RPC's answer carries them too)."""
        self.worker_id: str | None = None
        self.interval = 1.0
        self.incarnation = secrets.token_hex(8)
        """This process's: the same on every registration (asyncrl.liveness)."""
        self.lease_key = ""
        self.subject = ""
        """Where heartbeats go on NATS ("": the Heartbeat RPC)."""
        self.nc = nc
        """The NATS connection heartbeats go on (the service's; made at `start` if None)."""
        self._own_nc = False
        self._nats_url = nats_url
        """Where to connect if no `nc` is given (default: NATS_URL)."""
        self._identity = identity or {1: "rollout", 2: "reward", 3: "trainer"}.get(kind, "")
        self._inbox = ""
        self._forgotten = False
        """The scheduler answered a beat `unknown`, or a scheduler started: register again."""
        self._wake = asyncio.Event()
        """Set with `_forgotten`: the beat loop registers at once, not after its interval."""
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
            incarnation=self.incarnation,
        )
        async for attempt in connect_policy(max_delay_s=120):
            with attempt:
                # waits for the connection (a scheduler restarting: registered as it binds)
                resp = await self._stub.RegisterWorker(req, timeout=5, wait_for_ready=True)
        self.worker_id = resp.worker_id
        self.interval = resp.heartbeat_interval_s or 1.0
        self.subject, self.lease_key = resp.heartbeat_subject, resp.lease_key
        self._forgotten = False
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
        """One heartbeat after `interval`: on NATS if the scheduler named a subject and NATS is
        there, else the RPC, which registers again when the scheduler forgot this worker or did
        not answer. The RPC waits for the connection (`wait_for_ready`, up to three intervals):
        a scheduler replaced on a hand-over is reached the moment its successor binds (gRPC's
        reconnect backoff), which answers `known: false`, and the worker registers at once."""
        try:
            await asyncio.wait_for(self._wake.wait(), self.interval)
        except TimeoutError:
            pass
        self._wake.clear()
        if self._forgotten:
            log.warning("worker_unknown_reregistering", worker=self.worker_id)
            await self.register()
        if self.subject and self.nc is not None and self.nc.is_connected:
            load, now = int(self.load()), round(time.time(), 3)
            beat = Beat(self.worker_id, self.incarnation, self.lease_key, load, now)
            await self.nc.publish(self.subject, beat.encode(), reply=self._inbox)
            return
        await self._beat_rpc()

    async def _beat_rpc(self) -> None:
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
        await self._connect()  # first: a rollout follows announcements from its first bind
        wid = await self.register()
        if self.subject and self.nc is not None:
            await self._listen()
        self._task = asyncio.create_task(self._beat_forever())
        return wid

    async def _connect(self) -> None:
        """Connect to NATS unless the service gave its connection. No NATS: the Heartbeat RPC
        (and UpdateWeights calls), as with an older scheduler."""
        from asyncrl.natsutil import connect

        if self.nc is None:
            try:  # nats-py tries a first connection for ever: bounded here
                self.nc = await asyncio.wait_for(
                    connect(self._nats_url, self._identity, connect_timeout=2), NATS_WAIT_S
                )
                self._own_nc = True
            except Exception as e:  # noqa: BLE001 - any failure: the RPC path
                log.warning("heartbeat_nats_unavailable", error=repr(e), using="Heartbeat RPC")

    async def _listen(self) -> None:
        """Subscribe to the scheduler's `unknown` answers, a scheduler's start and, with
        `on_beat`, the reward workers' addresses."""
        self._inbox = self.nc.new_inbox()
        await self.nc.subscribe(self._inbox, cb=self._answered)
        await self.nc.subscribe(SCHEDULER_SUBJECT, cb=self._answered)
        if self.on_beat is not None:
            await self.nc.subscribe(REWARDS_SUBJECT, cb=self._rewards)

    async def _answered(self, msg) -> None:
        """`unknown` to a beat, or a scheduler started serving: register again, now."""
        if msg.data == UNKNOWN or msg.subject == SCHEDULER_SUBJECT:
            self._forgotten = True
            self._wake.set()

    async def _rewards(self, msg) -> None:
        try:
            addresses = json.loads(msg.data)
        except ValueError:
            return
        beat = scheduler_pb2.HeartbeatResponse(known=True, reward_addresses=addresses)
        self.on_beat(beat)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        await self._channel.close()
        await self._close_nats()

    async def _close_nats(self) -> None:
        if self._own_nc and self.nc is not None and not self.nc.is_closed:
            await self.nc.close()

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
        await self._close_nats()
