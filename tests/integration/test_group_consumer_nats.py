"""The trainer's GroupConsumer on a real nats-server: one ack covers a whole fetch, and a
delivery that never reached it makes it read the stream again from there, in order."""

from __future__ import annotations

import asyncio

from asyncrl.natsutil import STREAM, publish_group
from services.trainer.consumer import GroupConsumer, jetstream_connection
from tests.fakes.groups import EXP
from tests.fakes.groups import tiny_group as _group


async def _publish(js, *ids: str) -> None:
    for gid in ids:
        await publish_group(js, _group(gid))


async def _pull(consumer: GroupConsumer, n: int, timeout: float = 5.0) -> list:
    """Pull until n messages are taken (`pull` hands out what has arrived, up to n: on a loaded
    machine the last of a batch can come after the first pull returns) or `timeout` passes."""
    got: list = []
    deadline = asyncio.get_running_loop().time() + timeout
    while len(got) < n:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            break
        got += await consumer.pull(n - len(got), timeout=left)
    return got


async def _acked(js, name: str, timeout: float = 5.0) -> tuple[int, int]:
    """The consumer's (ack floor, acks pending) once nothing is pending, or as it is at
    `timeout`: the server applies an ack after the client's flush has returned (CI saw the
    floor at 0 right after it)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        info = await js.consumer_info(STREAM, name)
        got = (info.ack_floor.stream_seq, info.num_ack_pending)
        if got[1] == 0 or asyncio.get_running_loop().time() > deadline:
            return got
        await asyncio.sleep(0.02)


async def test_jetstream_connection_is_the_client_it_was_made_from(nc, js):
    """The contract behind the consumer's one use of a private nats-py attribute."""
    assert jetstream_connection(js) is nc
    assert jetstream_connection(nc.jetstream()) is nc


async def test_pull_one_ack_per_fetch_moves_ack_floor_to_newest(nc, js):
    await _publish(js, "g1", "g2", "g3")
    consumer = GroupConsumer(js, EXP)
    await consumer.open(1)
    got = await _pull(consumer, 3)
    assert [(p.seq, p.group.group_id) for p in got] == [(1, "g1"), (2, "g2"), (3, "g3")]
    await nc.flush()
    assert await _acked(js, consumer.name) == (3, 0)
    await consumer.close()


async def test_pull_delivery_taken_elsewhere_reopens_reads_it_in_order(js):
    await _publish(js, "g1", "g2", "g3", "g4", "g5")
    consumer = GroupConsumer(js, EXP)
    await consumer.open(1)
    assert [p.seq for p in await _pull(consumer, 2)] == [1, 2]
    # another subscriber on the same durable takes delivery 3: to this consumer it is lost
    thief = await js.pull_subscribe_bind(durable=consumer.name, stream=STREAM)
    [stolen] = await thief.fetch(1, timeout=5)
    assert stolen.metadata.sequence.stream == 3
    assert await consumer.pull(3, timeout=5) == []  # 4 and 5 follow a gap: not taken, not acked
    got = await _pull(consumer, 3)
    assert [(p.seq, p.group.group_id) for p in got] == [(3, "g3"), (4, "g4"), (5, "g5")]
    assert consumer.reopened == 1
    await thief.unsubscribe()
    await consumer.close()


async def test_open_again_delivers_from_start_seq(js):
    await _publish(js, "g1", "g2", "g3")
    consumer = GroupConsumer(js, EXP)
    await consumer.open(1)
    assert len(await _pull(consumer, 3)) == 3
    await consumer.open(2)  # as a restarted trainer does from its checkpoint
    assert [p.seq for p in await _pull(consumer, 2)] == [2, 3]
    await consumer.close()
