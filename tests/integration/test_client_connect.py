"""A call the client does not retry (submit, cancel, resume, checkpoint) waits for its
connection: a scheduler that starts listening a moment later answers it, and one that never
does is reported UNAVAILABLE with its address."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from asyncrl.client import CONNECT_TIMEOUT_S, AsyncrlClient, AsyncrlError
from asyncrl.net import free_port
from services.scheduler.server import create_scheduler


async def test_a_call_made_before_the_scheduler_listens_is_answered_once_it_does(nats_server):
    port = free_port()
    async with AsyncrlClient(f"127.0.0.1:{port}") as client:
        call = asyncio.create_task(client.cancel("no-such-experiment"))
        await asyncio.sleep(1.2)  # the first connection attempt has been refused by now
        assert not call.done()
        runtime, _ = await create_scheduler(nats_server.url, port=port)
        try:
            with pytest.raises(AsyncrlError) as err:
                await call
        finally:
            await runtime.close()
    assert err.value.code == grpc.StatusCode.NOT_FOUND, err.value  # sent, and answered


async def test_no_scheduler_at_all_is_unavailable_naming_the_address():
    address = f"127.0.0.1:{free_port()}"
    async with AsyncrlClient(address) as client:
        with pytest.raises(AsyncrlError) as err:
            await client.resume("x")
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.details == f"no connection to {address} within {CONNECT_TIMEOUT_S:g} s"
