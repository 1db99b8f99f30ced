"""`make up` with a standby scheduler (ASYNCRL_SCHEDULER_STANDBY=1) and a reward service: two
scheduler replicas on the scheduler port and the next one, `ps` naming the active one and the
standby, every service given both addresses; the active one killed (-9), the standby serves, the
reward worker registers with it, and the supervisor starts the killed one again as the standby.

One supervisor for the module; the tests run in file order and the last one stops it."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from asyncrl.client import AsyncrlClient, AsyncrlError
from asyncrl.net import free_port
from asyncrl.supervisor import pid_alive, port_in_use
from asyncrl.v1 import common_pb2
from tests.cluster import Cluster, wait_for


def two_free_ports() -> int:
    while True:
        port = free_port()
        if not port_in_use(port + 1):
            return port


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("var"))
    c.scheduler_port = two_free_ports()
    c.env |= {"ASYNCRL_SCHEDULER_PORT": str(c.scheduler_port), "ASYNCRL_SCHEDULER_STANDBY": "1"}
    c.env["COLUMNS"] = "300"  # `ps`'s table on one line a row
    c.started = c.sup("start", "--services", "scheduler,reward", "--timeout", "120")
    yield c
    c.sup("stop")
    for pid in c.seen_pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def both(cluster) -> str:
    return f"127.0.0.1:{cluster.scheduler_port},127.0.0.1:{cluster.scheduler_port + 1}"


def roles(cluster) -> dict[str, tuple[int, int]]:
    """role -> (replica, pid) of the running schedulers."""
    return {
        p["role"]: (p["replica"], p["pid"])
        for p in cluster.procs("scheduler")
        if p["status"] == "running" and p.get("role")
    }


def reward_workers(cluster) -> list:
    async def go():
        async with AsyncrlClient(both(cluster), timeout_s=3.0) as client:
            return await client.workers()

    try:
        workers = asyncio.run(go())
    except AsyncrlError:
        return []
    return [w for w in workers if w.kind == common_pb2.WORKER_KIND_REWARD]


def test_start_standby_ps_names_active_and_standby_services_get_both(cluster):
    assert cluster.started.returncode == 0, cluster.started.stdout + cluster.started.stderr
    assert cluster.state()["scheduler"] == both(cluster)
    # both start at once, so either may take the lease first; one serves, one waits
    assert wait_for(lambda: set(roles(cluster)) == {"active", "standby"}, 30)
    assert {r for r, _ in roles(cluster).values()} == {0, 1}
    ps = cluster.sup("ps").stdout
    assert "running (active)" in ps and "running (standby)" in ps


def test_active_killed_standby_serves_reward_follows_killed_one_standby(cluster):
    assert wait_for(lambda: reward_workers(cluster), 30)
    replica, pid = roles(cluster)["active"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    def swapped():
        active, standby = roles(cluster).get("active"), roles(cluster).get("standby")
        return active and standby and active[0] != replica and standby[1] != pid

    assert wait_for(swapped, 60)
    assert wait_for(lambda: reward_workers(cluster), 60)
    print(f"supervised takeover: roles swapped, reward listed {time.monotonic() - killed:.2f} s")


def test_stop_leaves_no_scheduler_behind(cluster):
    state = cluster.state()
    assert cluster.sup("stop").returncode == 0
    assert not [p["pid"] for p in state["processes"] if p["pid"] and pid_alive(p["pid"])]
    assert not port_in_use(cluster.scheduler_port) and not port_in_use(cluster.scheduler_port + 1)
