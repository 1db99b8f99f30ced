"""gRPC client helpers: channels with the message-size options every service uses, TLS and the
caller's token, and a health probe. Servers are made by `asyncrl.runtime.ServiceRuntime.serve`."""

from __future__ import annotations

import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncrl.security import credentials
from asyncrl.settings import settings

MAX_MSG = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MSG),
    ("grpc.max_receive_message_length", MAX_MSG),
    # a server that restarted (a hand-over, a crash) is found again within 0.1-1 s, not after
    # gRPC's default reconnect backoff (1 s growing to 120 s: 4 s late after a 2 s outage)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    # a client of a scheduler and its standby pings every FAILOVER_OPTIONS' keepalive: never
    # answered with GOAWAY for pinging too often
    ("grpc.http2.max_ping_strikes", 0),
]
FAILOVER_OPTIONS = {
    # a connection to a scheduler that is paused or cut off (no RST) is given up after
    # keepalive time + timeout, and the next address of the list is tried
    "grpc.keepalive_time_ms": 2000,
    "grpc.keepalive_timeout_ms": 2000,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.http2.max_pings_without_data": 0,
}


def grpc_target(address: str, resolve=socket.getaddrinfo) -> tuple[str, str | None]:
    """(the gRPC target, the host TLS checks) of `address`: `host:port` as it is (None: the
    target's own host), or a list `host:port,host:port` (a scheduler and its standby: the
    one that serves is used, `pick_first`) as an `ipv4:` or `ipv6:` target of their addresses
    (names resolved now) with the first host as the name to check. ValueError for a list that
    mixes IPv4 and IPv6."""
    parts = [a.strip() for a in address.split(",") if a.strip()]
    if len(parts) == 1:
        return parts[0], None
    resolved: list[tuple[int, str]] = []
    for part in parts:
        host, _, port = part.rpartition(":")
        host = host.strip("[]")
        family, *_, sockaddr = resolve(host, int(port), type=socket.SOCK_STREAM)[0]
        ip = sockaddr[0]
        resolved.append((family, f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"))
    families = {family for family, _ in resolved}
    if len(families) > 1:
        raise ValueError(f"{address!r}: mixes IPv4 and IPv6 addresses")
    scheme = "ipv6" if socket.AF_INET6 in families else "ipv4"
    first = parts[0].rpartition(":")[0].strip("[]")
    return f"{scheme}:{','.join(a for _, a in resolved)}", first


class _Bearer:
    """Adds `authorization: Bearer <token>` to every call's metadata. (grpc's own
    `access_token_call_credentials` runs a Python plugin on a new thread per call: twice the
    client CPU and ~1 ms more latency per call, measured by bench/control_plane.py's profile.)"""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class BearerUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class BearerStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    """(A channel files each interceptor under one call type only: one class per type.)"""

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class BearerBidi(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    """Server reflection (grpcurl's way in) is the one bidirectional stream."""

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def bearer_interceptors(token: str) -> list:
    return [BearerUnary(token), BearerStream(token), BearerBidi(token)]


def channel(
    address: str, identity: str | None = None, token: bool = True, options: dict | None = None
) -> grpc.aio.Channel:
    """A channel to `address` over TLS that presents `identity`'s token on every call (default
    ASYNCRL_IDENTITY, i.e. the CLI's admin). Plain when ASYNCRL_INSECURE. `options` replace
    those of CHANNEL_OPTIONS with the same name. `address` may list several `host:port`,
    comma-separated (a scheduler and its standby: `grpc_target`); each one's certificate must
    name the first host."""
    creds = credentials(identity or settings().identity)
    target, tls_name = grpc_target(address)
    extra = {} if tls_name is None else FAILOVER_OPTIONS
    if tls_name is not None and creds is not None:
        extra = extra | {"grpc.ssl_target_name_override": tls_name}
    merged = list((dict(CHANNEL_OPTIONS) | extra | (options or {})).items())
    if creds is None:
        return grpc.aio.insecure_channel(target, options=merged)
    interceptors = bearer_interceptors(creds.token) if token else None
    return grpc.aio.secure_channel(
        target,
        creds.channel_credentials(),
        options=merged,
        interceptors=interceptors,
    )


async def check_health(address: str, timeout: float = 2.0) -> bool:
    """Whether the server at `address` answers SERVING (health needs TLS but no token)."""
    async with channel(address, token=False) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING
