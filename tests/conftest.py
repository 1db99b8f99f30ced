"""Shared fixtures: a real nats-server with JetStream per test (port 0 style: a free port and
a temporary store dir), chained store_dir -> server -> client -> jetstream."""

from __future__ import annotations

import os

import pytest
import torch

from asyncrl.natsutil import LocalNatsServer, connect, ensure_stream

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def nats_server(tmp_path):
    with LocalNatsServer(tmp_path / "jetstream") as srv:
        yield srv


@pytest.fixture
async def nc(nats_server):
    client = await connect(nats_server.url)
    yield client
    await client.drain()


@pytest.fixture
async def js(nc):
    jetstream = nc.jetstream()
    await ensure_stream(jetstream)
    return jetstream
