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
from collections import Counter
from pathlib import Path

import pytest
import structlog
import torch

from asyncrl.natsutil import LocalNatsServer, connect, ensure_stream
from asyncrl.security import ensure_secrets
from tests.e2e.shared import FILES as SHARED_CLUSTER_FILES

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


TIER_TIMEOUT_S = {"unit": 120, "chaos": 120, "integration": 600, "e2e": 900}
"""Per-test timeout by the directory a test lives in (a test's own timeout mark wins)."""


SECONDS = json.loads((Path(__file__).parent / "durations.json").read_text())
"""Seconds each long test file took (`make test-durations`)."""
HEAVY_S, HEAVY_S_PER_TEST = 40, 10
"""A file at least this long, at least this long per test, starts services by the handful (a
cluster, torchrun, a real model) for each of its few tests."""


def heavy_files(nodeids) -> set[str]:
    """The heavy test files among `nodeids` (HEAVY_S, HEAVY_S_PER_TEST)."""
    tests = Counter(nodeid.split("::")[0] for nodeid in nodeids)
    return {f for f, n in tests.items() if SECONDS.get(f, 0) >= max(HEAVY_S, n * HEAVY_S_PER_TEST)}


def pytest_xdist_make_scheduler(config, log):
    """`make test`'s pytest-xdist schedule: each file is one unit of work (`--dist loadfile`),
    the heavy files together are one, so they run one after another on one worker while the
    other takes the light files (two heavy files at once on two cores slow each other down
    more than they gain: the suite took 19.8 min instead of 18.1), and the files that share
    one cluster are one (tests/e2e/shared.py)."""
    from xdist.scheduler import LoadScopeScheduling

    class HeavyFilesTogether(LoadScopeScheduling):
        heavy: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.heavy is None:
                self.heavy = heavy_files(self.collection or [])
            path = nodeid.split("::")[0]
            if path in SHARED_CLUSTER_FILES:
                return "shared-cluster"
            return "heavy" if path in self.heavy else path

    return HeavyFilesTogether(config, log)


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier (unit / integration / e2e: `-m "not e2e"`) and give it
    its tier's timeout. The heavy files go first, then those sharing a cluster, then the
    rest, each longest file first (`durations.json`), so that no long file starts last."""
    heavy = heavy_files(item.nodeid for item in items) - SHARED_CLUSTER_FILES

    def order(item) -> tuple[int, float]:
        path = item.nodeid.split("::")[0]
        group = 0 if path in heavy else 1 if path in SHARED_CLUSTER_FILES else 2
        return group, -SECONDS.get(path, 0)

    items.sort(key=order)
    tests_dir = Path(__file__).parent
    for item in items:
        tier = item.path.relative_to(tests_dir).parts[0]
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
