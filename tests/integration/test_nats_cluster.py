"""A real three-node NATS cluster on loopback (routes over mutual TLS with the route user's
password, as `make up` configures a node through ASYNCRL_NATS_ROUTES): the trajectory stream
and the scheduler's KV bucket at replicas 3 keep every message and keep taking writes while the
stream's leader is killed, and the node catches up when it comes back."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.js.api import ConsumerConfig

from asyncrl.natsutil import (
    KV_BUCKET,
    STREAM,
    ClusterNode,
    LocalNatsServer,
    connect,
    ensure_stream,
    train_subject,
)
from asyncrl.net import free_port

N_NODES = 3


@pytest.fixture
def cluster(tmp_path):
    ports = [free_port() for _ in range(N_NODES)]
    routes = [free_port() for _ in range(N_NODES)]
    nodes = []
    for i in range(N_NODES):
        others = tuple(f"127.0.0.1:{routes[j]}" for j in range(N_NODES) if j != i)
        node = ClusterNode(f"n{i}", "127.0.0.1", routes[i], others)
        nodes.append(
            LocalNatsServer(
                tmp_path / f"n{i}", port=ports[i], log_file=tmp_path / f"n{i}.log", cluster=node
            )
        )
    for node in nodes:
        node.start()
    yield nodes
    for node in nodes:
        node.stop()


def urls(nodes: list[LocalNatsServer]) -> str:
    return ",".join(node.url for node in nodes)


async def until(what, timeout: float = 30.0):
    """Retry `what()` until it returns without a NATS error (a cluster electing its JetStream
    leaders answers 'no responders' or times out meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await what()
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.25)


async def test_cluster_routes_are_authenticated_and_encrypted(cluster):
    """Each node's configuration carries the route user's password and mutual TLS, and the
    three nodes see each other (a node with no valid route could not form the JetStream
    meta group the next test needs)."""
    import json

    for node in cluster:
        config = json.loads(node.config_file.read_text())
        assert config["cluster"]["tls"]["verify"] is True
        assert config["cluster"]["authorization"]["user"] == "route"
        assert all(r.startswith("nats-route://route:") for r in config["cluster"]["routes"])
        assert config["server_name"] == node.cluster.name
    nc = await connect(urls(cluster), identity="scheduler")
    try:
        await until(lambda: ensure_stream(nc.jetstream()))
    finally:
        await nc.close()


async def test_replicated_stream_and_kv_survive_losing_the_leader(cluster, monkeypatch):
    monkeypatch.setenv("ASYNCRL_NATS_REPLICAS", "3")
    nc = await connect(urls(cluster), identity="scheduler", reconnect_time_wait=0.2)
    js = nc.jetstream()
    try:
        await until(lambda: ensure_stream(js))
        info = await until(lambda: js.stream_info(STREAM))
        assert info.config.num_replicas == 3
        assert len(info.cluster.replicas) == 2  # the leader plus two followers
        kv = await until(lambda: js.create_key_value(bucket=KV_BUCKET, replicas=3))
        await until(lambda: kv.put("experiment", b"v1"))

        subject = train_subject("exp")

        async def publish(i: int) -> None:
            await until(lambda: js.publish(subject, b"%d" % i, headers={"Nats-Msg-Id": f"g{i}"}))

        for i in range(40):
            await publish(i)
        leader = info.cluster.leader
        victim = next(n for n in cluster if n.cluster.name == leader)
        victim.proc.kill()  # the stream's leader dies: a follower must take over
        victim.proc.wait()
        for i in range(40, 80):
            await publish(i)
        for i in range(70, 80):
            await publish(i)  # retries of groups already stored: deduplicated, not stored twice
        await until(lambda: kv.put("experiment", b"v2"))

        after = await until(lambda: js.stream_info(STREAM))
        assert after.cluster.leader != leader
        assert after.state.messages == 80
        entry = await until(lambda: kv.get("experiment"))
        assert entry.value == b"v2"

        sub = await until(lambda: js.pull_subscribe(subject, "reader", config=ConsumerConfig()))
        got: list[int] = []
        while len(got) < 80:
            for msg in await until(lambda: sub.fetch(80 - len(got), timeout=5)):
                got.append(int(msg.data))
                await msg.ack()
        assert sorted(got) == list(range(80))

        victim.start()  # back: it catches up from the new leader
        deadline = time.monotonic() + 30
        while True:
            info = await until(lambda: js.stream_info(STREAM))
            peers = {r.name: r for r in info.cluster.replicas or []}
            if leader in peers and peers[leader].current:
                break
            assert time.monotonic() < deadline, f"{leader} did not catch up: {peers}"
            await asyncio.sleep(0.5)
    finally:
        await nc.close()


async def test_groups_and_ledger_events_ride_out_the_loss_of_the_leader(cluster, monkeypatch):
    """What the services write goes through `publish_group` and `Ledger.record`, without the
    test's own retries: both wait out the election of a new leader instead of failing (a
    rollout used to fail its group with NoRespondersError, a trainer its step)."""
    from asyncrl.ledger import Ledger, ensure_ledger
    from asyncrl.natsutil import LEDGER_STREAM, publish_group
    from tests.fakes.groups import EXP
    from tests.fakes.groups import tiny_group as _group

    monkeypatch.setenv("ASYNCRL_NATS_REPLICAS", "3")
    nc = await connect(urls(cluster), identity="scheduler", reconnect_time_wait=0.2)
    js = nc.jetstream()
    try:
        await until(lambda: ensure_stream(js))
        await until(lambda: ensure_ledger(js))
        info = await until(lambda: js.stream_info(STREAM))
        victim = next(n for n in cluster if n.cluster.name == info.cluster.leader)
        victim.proc.kill()
        victim.proc.wait()
        for i in range(20):
            await publish_group(js, _group(f"g{i}"))
        await Ledger(js, EXP).record("started", prompts=20, epochs=1)
        after = await until(lambda: js.stream_info(STREAM))
        assert after.state.messages == 20
        ledger = await until(lambda: js.stream_info(LEDGER_STREAM))
        assert ledger.state.messages == 1
    finally:
        await nc.close()
