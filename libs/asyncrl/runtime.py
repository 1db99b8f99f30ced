"""The one service runtime: what every asyncrl service process is made of.

    runtime = ServiceRuntime("rollout")
    nc = await runtime.connect_nats(url)                  # retried; drained on close
    ... build the service; runtime.on_close(service.close)
    port = await runtime.serve([(add_RolloutServicer_to_server, servicer)], [SERVICE_NAME])
    worker_id = await runtime.register(WorkerKind.ROLLOUT, capacity=64, load=lambda: ...)
    await runtime.serve_metrics(metrics_port, collector)
    ...
    await runtime.close()                                  # everything, in reverse order

Each step pushes its own undo onto one `AsyncExitStack`, so a service stops in the reverse of
the order it started: it stops heartbeating (the scheduler drops it when its lease lapses),
stops serving (health NOT_SERVING first, then in-flight RPCs get `grace` seconds), closes its
own logic, and drains NATS last. A failure
half-way through start-up closes what was already open.

Every gRPC server gets the standard health service, server reflection and one interceptor
chain: `asyncrl.security.AuthInterceptor` checks the caller's token against the policy, then
`ErrorInterceptor` maps exceptions to status codes in one place. Every port (gRPC, /metrics,
NATS) is TLS with the credentials of the service's identity (its name) unless ASYNCRL_INSECURE.
"""

from __future__ import annotations

import asyncio
import gc
import secrets
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client.registry import Collector

from asyncrl.errors import BadRequest, status_for, status_message
from asyncrl.grpcutil import SERVER_OPTIONS
from asyncrl.logging import get_logger
from asyncrl.metrics import MetricsServer
from asyncrl.natsutil import connect
from asyncrl.retry import connect_policy
from asyncrl.security import credentials, server_interceptors
from asyncrl.settings import settings
from asyncrl.storage import storage_error, storage_message
from asyncrl.v1 import common_pb2
from asyncrl.worker import WorkerAgent

log = get_logger()


def freeze_heap() -> None:
    """Move every object alive now (modules, a loaded model and tokenizer) out of the garbage
    collector's reach: later full collections then scan only what the service allocates while
    serving. Without it a full collection over torch/transformers objects stopped the event loop
    for 0.16-0.36 s several times a minute (bench/control_plane.py's profile)."""
    gc.collect()
    gc.freeze()


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Domain exceptions -> gRPC statuses for every unary and server-streaming method.

    `BadRequest`/`SpecError` -> INVALID_ARGUMENT, `NotFound` -> NOT_FOUND, `Conflict` ->
    FAILED_PRECONDITION, `TimeoutError` -> DEADLINE_EXCEEDED; anything else is INTERNAL with an
    error id that the log line carrying the traceback also has. A request whose bytes are no
    message of the method's type (truncated, a string not UTF-8) is INVALID_ARGUMENT naming
    `request`, before any handler runs (grpc itself answers such bytes UNKNOWN)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        decode = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                try:
                    _refuse_undecodable(request)
                    return await inner(request, context)
                except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
                    await _abort(context, method, exc)

            return grpc.unary_unary_rpc_method_handler(unary, decode, handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                try:
                    _refuse_undecodable(request)
                    async for item in inner_stream(request, context):
                        yield item
                except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
                    await _abort(context, method, exc)

            return grpc.unary_stream_rpc_method_handler(stream, decode, handler.response_serializer)
        return handler


class _Undecodable:
    """Request bytes that did not parse, in place of the request."""

    def __init__(self, size: int, error: Exception):
        self.size = size
        self.error = error


def _tolerant(deserializer: Callable | None) -> Callable | None:
    """`deserializer`, answering bytes it cannot parse with an `_Undecodable`."""
    if deserializer is None:
        return None

    def decode(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or what a parser raises instead
            return _Undecodable(len(data), exc)

    return decode


def _refuse_undecodable(request) -> None:
    if isinstance(request, _Undecodable):
        raise BadRequest("request", f"{request.size} bytes are no valid message: {request.error}")


async def _abort(context, method: str, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError | grpc.RpcError):
        raise exc
    await context.abort(*error_status(method, exc))


def error_status(method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status `exc` maps to and its message; an INTERNAL one is logged with its traceback
    under an error id the message names."""
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL and storage_error(exc) is not None:
        log.error("rpc_storage_full", method=method, error=repr(exc))
        return grpc.StatusCode.RESOURCE_EXHAUSTED, storage_message(exc)
    if code is grpc.StatusCode.INTERNAL:
        error_id = secrets.token_hex(4)
        log.error("rpc_internal_error", method=method, error_id=error_id, exc_info=exc)
        return code, f"internal error {error_id}: {type(exc).__name__} (details in the service log)"
    return code, status_message(str(exc)) or code.name.lower()


class ServiceRuntime:
    """NATS, the gRPC server, registration and /metrics of one service process; closed in
    reverse order by `close()`."""

    def __init__(self, name: str, host: str = "127.0.0.1", grace_s: float = 5.0):
        self.name = name
        self.host = host
        self.grace_s = grace_s
        self.port = 0
        self._agent: WorkerAgent | None = None
        self.nc = None
        """The NATS connection (`connect_nats`): heartbeats go on it too."""
        self.metrics_port: int | None = None
        self.credentials = credentials(name)
        self._stack = AsyncExitStack()
        self._health: health.aio.HealthServicer | None = None
        self.linger_s = 0.0
        """A reward worker that left serves on this long before it drains (set on a hand-over
        to a successor: the rollouts' next heartbeat brings them its address)."""
        self.busy: Callable[[], bool] = lambda: False
        """Whether this process serves work a successor must take up before it goes (a rollout
        with groups lately): `asyncrl.supervisor.handover`."""
        self.serving: Callable[[], bool] = lambda: True
        """Whether this process took up work (a rollout: an experiment's weights loaded); the
        successor of a busy process tells it to go only then."""

    @property
    def worker_id(self) -> str:
        """This worker's id now (a new one after it re-registered with a restarted scheduler)."""
        return (self._agent.worker_id or "") if self._agent else ""

    @property
    def address(self) -> str:
        """host:port other services reach this one at (ASYNCRL_ADVERTISE_HOST)."""
        return f"{settings().advertise_host}:{self.port}"

    def on_close(self, fn: Callable[[], Awaitable[object]]) -> None:
        """Run `fn` on close, before everything opened earlier is closed."""
        self._stack.push_async_callback(fn)

    async def connect_nats(self, url: str | None = None, max_delay_s: float = 60.0):
        """Connect (retrying while the server starts); drained on close."""
        async for attempt in connect_policy(max_delay_s=max_delay_s):
            with attempt:
                nc = await connect(url, identity=self.name)
        self.on_close(nc.drain)
        self.nc = nc
        return nc

    async def serve(
        self,
        servicers: Sequence[tuple[Callable, object]],
        service_names: Sequence[str],
        port: int = 0,
    ) -> int:
        """Start the gRPC server: `servicers` are (add_XServicer_to_server, servicer) pairs,
        plus health and reflection. Returns the bound port (pass 0 for a free one)."""
        interceptors = [*server_interceptors(), ErrorInterceptor()]
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        for add, servicer in servicers:
            add(servicer, server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        if self.credentials is None:
            self.port = server.add_insecure_port(f"{self.host}:{port}")
        else:
            creds = self.credentials.server_credentials()
            self.port = server.add_secure_port(f"{self.host}:{port}", creds)
        await server.start()
        self.on_close(lambda: self._stop_server(server))
        for name in ["", *service_names]:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(f"{self.name}_serving", host=self.host, port=self.port)
        return self.port

    async def _stop_server(self, server: grpc.aio.Server) -> None:
        await self._health.enter_graceful_shutdown()
        await server.stop(self.grace_s)

    async def register(
        self,
        kind: int,
        capacity: int = 1,
        load: Callable[[], int] = lambda: 0,
        scheduler: str | None = None,
        on_beat: Callable | None = None,
        device: str = "",
        on_agent: Callable[[WorkerAgent], None] | None = None,
        nats_url: str | None = None,
    ) -> str:
        """Register this worker with the scheduler and heartbeat until close. A rollout or
        reward worker leaves at close (the scheduler forgets it before its server drains); a
        trainer's lease lapses (its final checkpoint comes first). `on_agent` is given the
        agent before it registers."""
        agent = WorkerAgent(
            kind,
            self.address,
            capacity=capacity,
            scheduler=scheduler,
            load=load,
            identity=self.name,
            on_beat=on_beat,
            device=device,
            nc=self.nc,
            nats_url=nats_url,
        )
        self._agent = agent
        if on_agent is not None:  # before it registers: a bind may follow at once
            on_agent(agent)
        worker_id = await agent.start()
        leaves = kind in (common_pb2.WORKER_KIND_ROLLOUT, common_pb2.WORKER_KIND_REWARD)
        self.on_close(self._leave_then_linger if leaves else agent.stop)
        return worker_id

    async def _leave_then_linger(self) -> None:
        await self._agent.leave()
        if self.linger_s and self._agent.kind == common_pb2.WORKER_KIND_REWARD:
            log.info(f"{self.name}_lingering", seconds=self.linger_s)
            await asyncio.sleep(self.linger_s)

    async def serve_metrics(self, port: int | None, *collectors: Collector) -> int | None:
        """Serve `collectors` at https://ASYNCRL_METRICS_HOST:port/metrics from this event loop
        (None: off; 0: a free port)."""
        if port is None:
            return None
        server = MetricsServer(*collectors)
        tls = self.credentials.server_ssl_context() if self.credentials else None
        self.metrics_port = await server.start(port, settings().metrics_host, ssl_context=tls)
        self.on_close(server.stop)
        return self.metrics_port

    async def close(self) -> None:
        """Close everything, last opened first."""
        log.info(f"{self.name}_shutting_down", port=self.port)
        await self._stack.aclose()
        log.info(f"{self.name}_stopped")
