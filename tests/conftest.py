"""Shared fixtures: a real nats-server with JetStream per test (port 0 style: a free port and
a temporary store dir), chained store_dir -> server -> client -> jetstream.

The whole session runs secure, as `make up` does: one secrets directory (CA, certificates,
tokens, NATS users) is made before any test and handed to every service through
ASYNCRL_SECRETS; the `nc` fixture connects as the scheduler (the user that may do anything).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import structlog
import torch

from asyncrl.natsutil import LocalNatsServer, connect, ensure_stream
from asyncrl.security import ensure_secrets

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


TIER_TIMEOUT_S = {"unit": 120, "chaos": 120, "integration": 600, "e2e": 900}
"""Per-test timeout by the directory a test lives in (a test's own timeout mark wins)."""


DURATIONS = Path(__file__).parent / "durations.json"
"""Seconds each long test file took (`make test-durations`)."""
HEAVY_S = 40
"""An end-to-end or `slow` file at least this long starts services of its own by the handful
(a cluster, torchrun, a real model): such files run one after another on one xdist worker."""


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier (unit / integration / e2e: `-m "not e2e"`) and give it
    its tier's timeout. For `make test` (pytest-xdist, `--dist loadgroup`): each file is one
    unit of work and the heavy files (HEAVY_S) together are one, queued first, longest file
    first. Two heavy files at once on two cores slow each other down more than they gain (the
    suite took 19.8 min instead of 18.1); one beside light ones keeps both cores busy."""
    root = Path(__file__).parent.parent
    seconds = json.loads(DURATIONS.read_text())

    def file_of(item) -> str:
        return item.path.relative_to(root).as_posix()

    def is_heavy(item) -> bool:
        path = file_of(item)
        many = path.startswith("tests/e2e/") or item.get_closest_marker("slow") is not None
        return many and seconds.get(path, 0) >= HEAVY_S

    heavy = {item.nodeid for item in items if is_heavy(item)}
    items.sort(key=lambda item: (item.nodeid not in heavy, -seconds.get(file_of(item), 0)))
    for item in items:
        item.add_marker(pytest.mark.xdist_group("heavy" if item.nodeid in heavy else file_of(item)))
        tier = item.path.relative_to(root / "tests").parts[0]
        if tier not in TIER_TIMEOUT_S:
            continue
        item.add_marker(getattr(pytest.mark, tier))
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIER_TIMEOUT_S[tier]))


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


@pytest.fixture(autouse=True)
def _own_structlog_config():
    """A test that configures structlog (the CLI sends its lines to stderr) leaves the next
    test the configuration it found."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
