"""gRPC server/client helpers: health + reflection on every server, one error mapping."""

from __future__ import annotations

import functools
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from asyncrl.spec import SpecError

MAX_MSG = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MSG),
    ("grpc.max_receive_message_length", MAX_MSG),
]


class NotFound(LookupError):
    """A named entity (experiment, worker) does not exist."""


class Conflict(RuntimeError):
    """The request contradicts the current state (e.g. wrong experiment bound)."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one mapping from domain exceptions to gRPC status codes."""
    if isinstance(exc, SpecError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, Conflict):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def rpc_errors(fn: Callable) -> Callable:
    """Decorate an async unary servicer method: domain exceptions become gRPC statuses."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            code, msg = status_for(exc)
            await context.abort(code, msg)

    return wrapper


async def create_server(
    register: list[tuple[Callable, object]],
    service_names: list[str],
    port: int = 0,
    host: str = "127.0.0.1",
) -> tuple[grpc.aio.Server, int]:
    """Start an aio server with the given servicers plus health and reflection.

    `register` is a list of (add_XServicer_to_server, servicer). Returns (server, bound_port);
    pass port=0 in tests.
    """
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    for add, servicer in register:
        add(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.health_servicer = health_servicer  # for graceful NOT_SERVING on shutdown
    return server, bound


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def check_health(address: str, timeout: float = 2.0) -> bool:
    async with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING
