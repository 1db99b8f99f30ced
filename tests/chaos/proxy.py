"""A gRPC proxy in front of one rollout that can lose a reply after the work is done.

    python -m tests.chaos.proxy --listen 127.0.0.1:P --upstream 127.0.0.2:P

Every call is forwarded as raw bytes (no protos needed), unary except the methods in
STREAM_METHODS, whose replies are a stream (bytes carry no method kind, so the set says it).
Each SIGUSR1 arms one loss, after the rollout generated and published a group: the next
GenerateGroup reply is thrown away, or the next GenerateGroups message that carries a published
summary (and the stream with it: the upstream call is cancelled); the caller gets UNAVAILABLE,
as if the connection died on the way back. The rollout binds the upstream address and
advertises the listen one (its `--host`/`--port` with ASYNCRL_ADVERTISE_HOST), so the scheduler
reaches it only through here. Each loss is printed as a JSON line {"event": "reply_dropped",
"method", "t"}. Both legs are TLS with the run's certificate (plain under ASYNCRL_INSECURE); the
caller's token goes on with the other metadata, and its deadline with the call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time

import grpc

from asyncrl.grpcutil import CHANNEL_OPTIONS
from asyncrl.security import credentials
from asyncrl.v1 import rollout_pb2

LOSSY_METHOD = "/asyncrl.v1.Rollout/GenerateGroup"
LOSSY_STREAM = "/asyncrl.v1.Rollout/GenerateGroups"
STREAM_METHODS = frozenset({LOSSY_STREAM})
"""The unary-stream methods forwarded; every other method is forwarded as unary."""


def _caller_metadata(context: grpc.aio.ServicerContext) -> list[tuple[str, str]] | None:
    """The caller's metadata (its token among it), less what gRPC sets on each hop."""
    metadata = [
        (k, v) for k, v in context.invocation_metadata() or () if not k.startswith((":", "grpc-"))
    ]
    return metadata or None


async def _abort_as(context: grpc.aio.ServicerContext, e: grpc.aio.AioRpcError) -> None:
    """Fail the caller's call as the upstream failed, trailing metadata (asyncrl-fault) too."""
    trailing = tuple((k, v) for k, v in e.trailing_metadata() or () if not k.startswith("grpc-"))
    await context.abort(e.code(), e.details() or "", trailing)


def _published(reply: bytes) -> bool:
    return any(s.published for s in rollout_pb2.GroupSummaries.FromString(reply).summaries)


class Forwarder(grpc.GenericRpcHandler):
    """Forwards calls to `channel`; `armed` replies of LOSSY_METHOD, or messages of LOSSY_STREAM
    with a published group, are lost."""

    def __init__(self, channel: grpc.aio.Channel):
        self.channel = channel
        self.armed = 0
        self.dropped = 0

    def _drop(self, method: str) -> None:
        self.armed -= 1
        self.dropped += 1
        print(
            json.dumps({"event": "reply_dropped", "method": method, "t": time.time()}), flush=True
        )

    def service(self, details: grpc.HandlerCallDetails):
        method = details.method
        if method in STREAM_METHODS:
            return self._stream(method)
        call = self.channel.unary_unary(method)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                reply = await call(
                    request, timeout=context.time_remaining(), metadata=_caller_metadata(context)
                )
            except grpc.aio.AioRpcError as e:
                await _abort_as(context, e)
            if method == LOSSY_METHOD and self.armed:
                self._drop(method)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "reply lost (chaos proxy)")
            return reply

        return grpc.unary_unary_rpc_method_handler(forward)

    def _stream(self, method: str) -> grpc.RpcMethodHandler:
        open_call = self.channel.unary_stream(method)

        async def forward(request: bytes, context: grpc.aio.ServicerContext):
            call = open_call(
                request, timeout=context.time_remaining(), metadata=_caller_metadata(context)
            )
            try:
                async for reply in call:
                    if method == LOSSY_STREAM and self.armed and _published(reply):
                        self._drop(method)
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "reply lost (chaos proxy)")
                    yield reply
            except grpc.aio.AioRpcError as e:
                await _abort_as(context, e)
            finally:  # a lost reply, or the caller gone (cancelled, past its deadline), ends it
                call.cancel()

        return grpc.unary_stream_rpc_method_handler(forward)


async def serve(listen: str, upstream: str) -> None:
    creds = credentials("scheduler")  # its files: the CA and this host's certificate
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    if creds is None:
        channel = grpc.aio.insecure_channel(upstream, options=CHANNEL_OPTIONS)
        server.add_insecure_port(listen)
    else:  # TLS both ways; the caller's token travels on in the forwarded metadata
        # the rollout's certificate names loopback, not the upstream's 127.0.0.2
        options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", "localhost")]
        channel = grpc.aio.secure_channel(upstream, creds.channel_credentials(), options)
        server.add_secure_port(listen, creds.server_credentials())
    forwarder = Forwarder(channel)
    server.add_generic_rpc_handlers((forwarder,))
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(
        signal.SIGUSR1, lambda: setattr(forwarder, "armed", forwarder.armed + 1)
    )
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print(
        json.dumps({"event": "proxy_serving", "listen": listen, "upstream": upstream}), flush=True
    )
    await stop.wait()
    await server.stop(1.0)
    await channel.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", required=True)
    p.add_argument("--upstream", required=True)
    args = p.parse_args()
    asyncio.run(serve(args.listen, args.upstream))


if __name__ == "__main__":
    main()
