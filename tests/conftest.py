"""Shared fixtures: a real nats-server with JetStream per test (port 0 style: a free port and
a temporary store dir), chained store_dir -> server -> client -> jetstream.

The whole session runs secure, as `make up` does: one secrets directory (CA, certificates,
tokens, NATS users) is made before any test and handed to every service through
ASYNCRL_SECRETS; the `nc` fixture connects as the scheduler (the user that may do anything).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from asyncrl.natsutil import LocalNatsServer, connect, ensure_stream
from asyncrl.security import ensure_secrets

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config):
    if not os.environ.get("ASYNCRL_SECRETS"):
        os.environ["ASYNCRL_SECRETS"] = tempfile.mkdtemp(prefix="asyncrl-secrets-")
    ensure_secrets()


@pytest.fixture
def nats_server(tmp_path):
    with LocalNatsServer(tmp_path / "jetstream") as srv:
        yield srv


@pytest.fixture
async def nc(nats_server):
    client = await connect(nats_server.url, identity="scheduler")
    yield client
    await client.drain()


@pytest.fixture
async def js(nc):
    jetstream = nc.jetstream()
    await ensure_stream(jetstream)
    return jetstream
