"""JetStream behaviour asyncrl relies on, against a real nats-server."""

from __future__ import annotations

import asyncio
import socket

import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from asyncrl.convert import group_from_bytes
from asyncrl.natsutil import STREAM, LocalNatsServer, publish_group, train_subject
from asyncrl.types import Sample, TrajectoryGroup


def _group(gid: str) -> TrajectoryGroup:
    return TrajectoryGroup(
        experiment_id="exp1",
        group_id=gid,
        prompt_id="p" + gid,
        prompt="1+1=",
        answer="2",
        prompt_ids=[1, 2, 3],
        samples=[Sample(output_ids=[4, 5], logprobs=[-0.5, -0.25], versions=[0, 1])],
        start_version=0,
    )


async def test_publish_same_group_id_twice_is_deduplicated(js):
    seq1, dup1 = await publish_group(js, _group("g1"))
    seq2, dup2 = await publish_group(js, _group("g1"))
    assert (dup1, dup2) == (False, True)
    assert seq1 == seq2
    info = await js.stream_info(STREAM)
    assert info.state.messages == 1


async def test_durable_consumer_resumes_after_reconnect(js, nc, nats_server):
    for i in range(3):
        await publish_group(js, _group(f"g{i}"))
    cfg = ConsumerConfig(
        durable_name="trainer-exp1",
        ack_policy=AckPolicy.EXPLICIT,
        filter_subject=train_subject("exp1"),
    )
    sub = await js.pull_subscribe(train_subject("exp1"), durable="trainer-exp1", config=cfg)
    msgs = await sub.fetch(1, timeout=5)
    assert group_from_bytes(msgs[0].data).group_id == "g0"
    await msgs[0].ack_sync()
    await sub.unsubscribe()
    # a new subscription to the same durable continues where the first one acked
    sub2 = await js.pull_subscribe(train_subject("exp1"), durable="trainer-exp1", config=cfg)
    msgs = await sub2.fetch(2, timeout=5)
    assert [group_from_bytes(m.data).group_id for m in msgs] == ["g1", "g2"]


async def test_unacked_message_is_redelivered_after_ack_wait(js):
    await publish_group(js, _group("g9"))
    cfg = ConsumerConfig(
        durable_name="redeliver",
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=1.0,
        filter_subject=train_subject("exp1"),
    )
    sub = await js.pull_subscribe(train_subject("exp1"), durable="redeliver", config=cfg)
    first = (await sub.fetch(1, timeout=5))[0]
    assert first.metadata.num_delivered == 1
    await asyncio.sleep(1.5)  # not acked: JetStream redelivers once ack_wait passes
    again = (await sub.fetch(1, timeout=5))[0]
    assert group_from_bytes(again.data).group_id == "g9"
    assert again.metadata.num_delivered == 2
    await again.ack_sync()


def test_local_server_on_a_picked_port_taken_meanwhile_starts_on_another(tmp_path):
    """The port picked at construction is bound by someone else before the server starts (two
    test workers side by side): the server exits at once, and `start` picks another port."""
    server = LocalNatsServer(tmp_path / "jetstream")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", server.port))
        taken.listen()
        with server:
            assert server.port != taken.getsockname()[1]
            with socket.create_connection(("127.0.0.1", server.port), timeout=2):
                pass


def test_local_server_on_a_given_port_taken_says_so(tmp_path):
    """A port the caller chose is not changed behind its back."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = LocalNatsServer(tmp_path / "jetstream", port=taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="nats-server exited"):
            server.start()
