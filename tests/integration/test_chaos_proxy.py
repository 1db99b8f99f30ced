"""The lost-reply chaos proxy (tests/chaos/proxy.py) in process, in front of a real grpc.aio
server that answers Rollout.GenerateGroup and GenerateGroups with scripted summaries.

The legs are plain: what is tested is what the Forwarder does with a call (TLS on both legs is
the channel and port `serve` hands it, exercised by `make chaos`)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from asyncrl.v1 import rollout_pb2, rollout_pb2_grpc
from tests.chaos.proxy import LOSSY_STREAM, Forwarder

TIMEOUT_S = 10.0
CANCEL_S = 5.0
"""How soon the rollout's call must be cancelled: well before the caller's deadline ends it."""
TOKEN = ("authorization", "Bearer test-token")
FAULT = "asyncrl-fault"


def summary(group_id: str, published: bool) -> rollout_pb2.GroupSummary:
    status = rollout_pb2.GROUP_STATUS_ACCEPTED if published else rollout_pb2.GROUP_STATUS_REJECTED
    return rollout_pb2.GroupSummary(group_id=group_id, status=status, published=published)


STREAM = [
    rollout_pb2.GroupSummaries(summaries=[summary("g0", published=False)]),
    rollout_pb2.GroupSummaries(summaries=[summary("g1", True), summary("g2", False)]),
    rollout_pb2.GroupSummaries(summaries=[summary("g3", published=True)]),
]
"""What the rollout answers GenerateGroups: a filtered group, then two messages that publish."""


class ScriptedRollout(rollout_pb2_grpc.RolloutServicer):
    """Answers STREAM, the last message only once `release` is set (the test's way to see
    whether the proxy ended the call early: `ended`); records what each call arrived with."""

    def __init__(self):
        self.release = asyncio.Event()
        self.ended = asyncio.Event()
        self.metadata: dict[str, str] = {}
        self.time_remaining: float | None = None

    async def GenerateGroup(self, request, context):
        if request.group_id == "no-reward":
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "reward down", ((FAULT, "reward-unavailable"),)
            )
        return summary(request.group_id, published=True)

    async def GenerateGroups(self, request, context):
        self.metadata = dict(context.invocation_metadata())
        self.time_remaining = context.time_remaining()
        # the call held back by `release` can end early only by a cancel (a callback, as the
        # cancel can land outside this generator, while the server sends what it yielded)
        context.add_done_callback(lambda _: self.ended.set())
        for message in STREAM[:-1]:
            yield message
        await self.release.wait()
        yield STREAM[-1]


@pytest.fixture
async def proxied():
    """(rollout servicer, forwarder, a stub that reaches the rollout through the proxy)."""
    rollout = ScriptedRollout()
    upstream = grpc.aio.server()
    rollout_pb2_grpc.add_RolloutServicer_to_server(rollout, upstream)
    upstream_port = upstream.add_insecure_port("127.0.0.1:0")
    await upstream.start()
    forwarder = Forwarder(grpc.aio.insecure_channel(f"127.0.0.1:{upstream_port}"))
    proxy = grpc.aio.server()
    proxy.add_generic_rpc_handlers((forwarder,))
    proxy_port = proxy.add_insecure_port("127.0.0.1:0")
    await proxy.start()
    caller = grpc.aio.insecure_channel(f"127.0.0.1:{proxy_port}")
    yield rollout, forwarder, rollout_pb2_grpc.RolloutStub(caller)
    await caller.close()
    await proxy.stop(None)
    await forwarder.channel.close()
    await upstream.stop(None)


def groups_request() -> rollout_pb2.GenerateGroupsRequest:
    return rollout_pb2.GenerateGroupsRequest(
        groups=[rollout_pb2.GenerateGroupRequest(group_id=f"g{i}") for i in range(4)]
    )


async def test_generate_groups_unarmed_forwards_every_message_with_token_and_deadline(proxied):
    rollout, forwarder, stub = proxied
    rollout.release.set()
    call = stub.GenerateGroups(groups_request(), timeout=TIMEOUT_S, metadata=(TOKEN,))
    received = [message async for message in call]
    assert received == STREAM
    assert await call.code() == grpc.StatusCode.OK
    assert rollout.metadata[TOKEN[0]] == TOKEN[1]
    # the caller's deadline, as gRPC carries it (grpc-timeout rounds up: 10.1 s seen)
    assert rollout.time_remaining == pytest.approx(TIMEOUT_S, abs=0.5)
    assert forwarder.dropped == 0


async def test_generate_groups_armed_loses_the_first_published_message_unavailable(proxied, capsys):
    rollout, forwarder, stub = proxied
    forwarder.armed = 1
    call = stub.GenerateGroups(groups_request(), timeout=TIMEOUT_S, metadata=(TOKEN,))
    assert await call.read() == STREAM[0]  # nothing published: it goes through
    with pytest.raises(grpc.aio.AioRpcError) as lost:
        await call.read()  # STREAM[1] publishes g1: lost, and the call with it
    assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
    assert lost.value.details() == "reply lost (chaos proxy)"
    assert (forwarder.armed, forwarder.dropped) == (0, 1)
    # the rollout's call was cancelled while it held its last message back
    await asyncio.wait_for(rollout.ended.wait(), CANCEL_S)
    assert f'"method": "{LOSSY_STREAM}"' in capsys.readouterr().out


async def test_generate_groups_caller_cancels_upstream_call_cancelled(proxied):
    rollout, _, stub = proxied
    call = stub.GenerateGroups(groups_request(), timeout=TIMEOUT_S)
    assert await call.read() == STREAM[0]
    call.cancel()
    await asyncio.wait_for(rollout.ended.wait(), CANCEL_S)


async def test_generate_group_upstream_fault_reaches_caller_with_trailing_metadata(proxied):
    _, _, stub = proxied
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stub.GenerateGroup(
            rollout_pb2.GenerateGroupRequest(group_id="no-reward"), timeout=TIMEOUT_S
        )
    assert (failed.value.code(), failed.value.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "reward down",
    )
    assert dict(failed.value.trailing_metadata())[FAULT] == "reward-unavailable"


async def test_generate_group_armed_loses_the_reply_unavailable(proxied):
    _, forwarder, stub = proxied
    request = rollout_pb2.GenerateGroupRequest(group_id="g0")
    assert (await stub.GenerateGroup(request, timeout=TIMEOUT_S)).published
    forwarder.armed = 1
    with pytest.raises(grpc.aio.AioRpcError) as lost:
        await stub.GenerateGroup(request, timeout=TIMEOUT_S)
    assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (forwarder.armed, forwarder.dropped) == (0, 1)
