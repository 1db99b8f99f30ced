"""One torch-engine cluster for the end-to-end files that only submit experiments to it.

Starting all services under the supervisor costs about 17 CPU-seconds (start and stop); ten
files each starting their own spent a tenth of `make test`'s CPU on it. These files share one:
the schedule (tests/conftest.py) runs them one after another on one worker, the cluster starts
with the first and stops after the last (`release_unless_next_shares`). Each test gets it in
its starting shape (one replica of every service, every worker registered, no experiment
running), and reads only the log lines written since it got it (`Cluster.mark_logs`). A test
that scales a service or stops one sets it back before it returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

from asyncrl.client import AsyncrlClient, is_terminal
from asyncrl.v1 import common_pb2
from tests.cluster import Cluster, wait_for
from tests.e2e.experiment import start_cluster

FILES = frozenset(
    f"tests/e2e/{name}.py"
    for name in (
        "test_end_to_end",
        "test_smollm2_learn",
        "test_end_to_end_broadcast",
        "test_chaos_trainer",
        "test_math_smoke",
        "test_export",
        "test_objectives",
        "test_run_end",
        "test_end_to_end_lora",
        "test_resume",
    )
)
"""The files whose `cluster` is the shared one (tests/e2e/conftest.py)."""

KINDS = sorted(
    (common_pb2.WORKER_KIND_ROLLOUT, common_pb2.WORKER_KIND_REWARD, common_pb2.WORKER_KIND_TRAINER)
)

_started: list[tuple[Iterator[Cluster], Cluster]] = []
"""The shared cluster while it runs: (start_cluster's generator, the cluster)."""


def shares(nodeid: str) -> bool:
    return nodeid.split("::")[0] in FILES


def shared_cluster(make_var: Callable[[], Path]) -> Cluster:
    """The running shared cluster, started on first use, in its starting shape."""
    if not _started:
        started = start_cluster(make_var(), engine="torch")
        _started.append((started, next(started)))
    _, cluster = _started[0]
    wait_for(lambda: _in_starting_shape(cluster), timeout=120, interval=0.5)
    cluster.mark_logs()
    return cluster


def _in_starting_shape(cluster: Cluster) -> bool:
    """One live process per service, one fresh worker of each kind, no experiment running."""
    state = cluster.state()
    for service in ("scheduler", "reward", "rollout", "trainer"):
        procs = [p for p in state["processes"] if p["service"] == service]
        if [p["status"] for p in procs] != ["running"]:
            return False
    if sorted(w.kind for w in cluster.workers()) != KINDS:
        return False
    return not asyncio.run(_running_experiments(cluster))


async def _running_experiments(cluster: Cluster) -> list[str]:
    async with AsyncrlClient(cluster.scheduler) as client:
        return [e.id for e in await client.list() if not is_terminal(e)]


def release_unless_next_shares(nextitem) -> None:
    """Stop the shared cluster unless the next test to run uses it too."""
    if nextitem is None or not shares(nextitem.nodeid):
        release()


def release() -> None:
    while _started:
        started, _ = _started.pop()
        started.close()  # start_cluster's `finally`: stop, kill what is left
