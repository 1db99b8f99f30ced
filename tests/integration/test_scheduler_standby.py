"""A standby scheduler (services/scheduler/leadership.py): two real scheduler processes on one
real nats-server (TLS and tokens as everywhere), clients and a worker dialing both addresses.
The active one killed (-9): the standby binds, serves the same experiments, and the client and
the worker follow it. The active one paused (SIGSTOP): the standby takes over once the lease
lapses, and a client of both addresses reaches it past the paused one; resumed, the paused one
steps down (exit STEPPED_DOWN) and writes nothing to NATS."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.client import AsyncrlClient, AsyncrlError
from asyncrl.grpcutil import check_health
from asyncrl.ledger import LEDGER_STREAM
from asyncrl.natsutil import KV_BUCKET
from asyncrl.net import free_port
from asyncrl.v1 import common_pb2
from asyncrl.worker import WorkerAgent
from services.scheduler.history import STREAM as HISTORY_STREAM
from services.scheduler.leadership import STEPPED_DOWN
from tests.fakes import scheduler_env

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 1.5
DEADLINE_S = 60.0
"""Liveness only: each step takes a few seconds; this is how long a test waits for one."""
files = scheduler_env.files


class Scheduler:
    """`python -m services.scheduler` on `port`, its log in `log`."""

    def __init__(self, nats_url: str, port: int, log: Path):
        self.port = port
        self.log = log
        env = {
            **os.environ,
            "NATS_URL": nats_url,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "libs"), str(ROOT)]),
        }
        cmd = [sys.executable, "-m", "services.scheduler", "--port", str(port)]
        cmd += ["--leader-lease", str(LEASE_S), "--heartbeat-interval", "0.2"]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def said(self, event: str) -> bool:
        return event in self.log.read_text(errors="replace")

    async def serving(self) -> bool:
        return await check_health(self.address, timeout=1.0)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


async def until(pred, what: str, timeout: float = DEADLINE_S):
    """pred()'s (awaited) value once truthy; AssertionError naming `what` past `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout:g} s")


@pytest.fixture
async def pair(nats_server, tmp_path):
    """(active, standby): the first serving, the second waiting for the lease."""
    started: list[Scheduler] = []

    def start(name: str) -> Scheduler:
        s = Scheduler(nats_server.url, free_port(), tmp_path / f"{name}.log")
        started.append(s)
        return s

    try:
        active = start("a")
        await until(active.serving, "the first scheduler serves")
        standby = start("b")
        await until(lambda: standby.said("scheduler_standby"), "the second waits as standby")
        yield active, standby
    finally:
        for s in started:
            if s.proc.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)  # a paused one dies too
            s.kill()


def both(pair) -> str:
    return ",".join(s.address for s in pair)


async def get_or_none(client: AsyncrlClient, experiment_id: str):
    try:
        return await client.get(experiment_id)
    except AsyncrlError:
        return None


async def test_standby_active_killed_standby_serves_experiment_client_worker_follow(
    pair, files, nats_server
):
    active, standby = pair
    assert not await standby.serving()  # a standby binds no port
    async with AsyncrlClient(both(pair), timeout_s=5.0) as client:
        exp = await client.submit(json.loads(scheduler_env.spec(files)))
        agent = WorkerAgent(
            common_pb2.WORKER_KIND_REWARD,
            "127.0.0.1:1",
            scheduler=both(pair),
            identity="reward",
            nats_url=nats_server.url,
        )
        await agent.start()
        try:
            active.kill()
            killed = time.monotonic()
            got = await until(lambda: get_or_none(client, exp.id), "the experiment via the list")
            took = time.monotonic() - killed
            assert got.id == exp.id and await standby.serving()
            assert standby.said("lease_taken_over")

            async def registered():
                workers = await client.workers()
                return [w for w in workers if w.kind == common_pb2.WORKER_KIND_REWARD]

            rewards = await until(registered, "the worker registered with the standby")
            assert [w.address for w in rewards] == ["127.0.0.1:1"]
        finally:
            await agent.stop()
    print(f"takeover: the experiment served again {took:.2f} s after kill -9")


async def stream_sequences(js) -> dict[str, int]:
    names = (f"KV_{KV_BUCKET}", LEDGER_STREAM, HISTORY_STREAM)
    return {name: (await js.stream_info(name)).state.last_seq for name in names}


async def test_standby_paused_active_resumed_steps_down_writes_nothing(pair, files, nc):
    active, standby = pair
    js = nc.jetstream()
    async with AsyncrlClient(active.address, timeout_s=60.0) as to_active:
        exp = await to_active.submit(json.loads(scheduler_env.spec(files)))
        os.kill(active.proc.pid, signal.SIGSTOP)
        paused = time.monotonic()
        # a request that waits for the paused scheduler: it reads it when resumed
        late = asyncio.create_task(to_active.submit(json.loads(scheduler_env.spec(files))))
        await until(standby.serving, "the standby took over")
        print(f"takeover of a paused scheduler: serving {time.monotonic() - paused:.2f} s after")
        async with AsyncrlClient(both(pair), timeout_s=5.0) as client:  # the first one paused
            asked = time.monotonic()
            got = await until(lambda: get_or_none(client, exp.id), "the experiment via the list")
            print(f"the list past a paused first scheduler: {time.monotonic() - asked:.2f} s")
        assert got.id == exp.id
        os.kill(standby.proc.pid, signal.SIGSTOP)  # from here nobody may write
        await asyncio.sleep(0.5)  # what the standby sent before its pause is stored
        before = await stream_sequences(js)
        os.kill(active.proc.pid, signal.SIGCONT)
        code = await until(lambda: active.proc.poll(), "the resumed scheduler exits")
        after = await stream_sequences(js)
        with pytest.raises(AsyncrlError):
            await late
    assert code == STEPPED_DOWN
    assert active.said("scheduler_stepped_down")
    assert after == before
    os.kill(standby.proc.pid, signal.SIGCONT)
    async with AsyncrlClient(both(pair), timeout_s=5.0) as client:
        got = await until(lambda: get_or_none(client, exp.id), "the standby serves on")
    assert got.id == exp.id and standby.proc.poll() is None
