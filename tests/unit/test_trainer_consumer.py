"""GroupConsumer.pull over a fake connection: one pull request serves the pulls until it is
filled or expires; never more than asked, the surplus handed out next, in stream order;
garbage decodes to an error, not a raise; one ack per request, never past a delivery that did
not arrive; a status reply other than an expiry has the consumer re-created."""

from __future__ import annotations

import json
from types import SimpleNamespace

from nats.aio.msg import Msg

from asyncrl.convert import group_to_bytes
from asyncrl.types import Sample, TrajectoryGroup
from services.trainer.consumer import GroupConsumer, header_safe


class FakeMsg:
    """A JetStream message as delivered: its delivery metadata in the reply subject, as
    nats-server sends it, read by nats-py's `Msg.metadata`."""

    def __init__(self, seq: int, data: bytes, delivery: int | None = None, delivered: int = 1):
        delivery = seq if delivery is None else delivery
        self.reply = f"$JS.ACK.ASYNCRL_TRAJ.trainer-e.{delivered}.{seq}.{delivery}.1700000000.0"
        self.data = data
        self.headers = None
        self.acked = False

    @property
    def metadata(self) -> Msg.Metadata:
        return Msg(None, subject="x", reply=self.reply).metadata

    async def ack(self) -> None:
        self.acked = True


def _status(code: str, description: str = "") -> SimpleNamespace:
    return SimpleNamespace(headers={"Status": code, "Description": description}, data=b"")


class FakeNats:
    """Answers each pull request (a publish) with the next of `answers`: what the server
    delivers to the consumer's inbox for it (nothing once they run out)."""

    def __init__(self, answers: list[list]):
        self.answers = answers
        self.requests: list[int] = []
        self.consumer: GroupConsumer | None = None

    async def publish(self, subject: str, body: bytes, reply: str = "") -> None:
        assert subject == "$JS.API.CONSUMER.MSG.NEXT.ASYNCRL_TRAJ.trainer-e"
        self.requests.append(json.loads(body)["batch"])
        for msg in self.answers.pop(0) if self.answers else []:
            await self.consumer._receive(msg)


def _consumer(answers: list[list]) -> tuple[GroupConsumer, FakeNats]:
    nc = FakeNats(answers)
    consumer = GroupConsumer(js=SimpleNamespace(_nc=nc), experiment_id="e")
    consumer._sub = object()  # opened
    nc.consumer = consumer
    return consumer, nc


def _bytes(gid: str) -> bytes:
    g = TrajectoryGroup("e", gid, "p", "q", "a", [1], [Sample([2], [-1.0], [0])])
    return group_to_bytes(g)


async def test_pull_request_brings_more_than_asked_hands_n_keeps_rest_in_order():
    # a request made for an earlier, larger pull brings more than this pull asks for
    msgs = [FakeMsg(seq, _bytes(f"g{seq}")) for seq in range(1, 6)]
    consumer, nc = _consumer([msgs])
    first = await consumer.pull(2, timeout=0.1)
    assert [p.seq for p in first] == [1, 2]
    assert consumer.held == 3
    # one ack (AckPolicy.ALL) for the newest that arrived; the position is the checkpoint's
    assert [m.acked for m in msgs] == [False, False, False, False, True]
    second = await consumer.pull(2, timeout=0.1)
    third = await consumer.pull(2, timeout=0.1)
    assert [p.seq for p in second] == [3, 4]
    assert [(p.seq, p.group.group_id) for p in third] == [(5, "g5")]
    assert nc.requests == [2]  # the held ones were handed out without a request
    assert await consumer.pull(2, timeout=0.1) == []
    assert nc.requests == [2, 2]


async def test_pull_open_request_serves_later_pulls_without_asking_again_acks_when_filled():
    msgs = [FakeMsg(seq, _bytes(f"g{seq}")) for seq in range(1, 5)]
    consumer, nc = _consumer([msgs[:1]])
    assert [p.seq for p in await consumer.pull(4, timeout=0.1)] == [1]
    for msg in msgs[1:3]:  # published later: the open request brings them
        await consumer._receive(msg)
    assert [p.seq for p in await consumer.pull(3, timeout=0.1)] == [2, 3]
    assert nc.requests == [4] and not any(m.acked for m in msgs)
    await consumer._receive(msgs[3])  # the fourth fills the request: its newest is acked
    assert [p.seq for p in await consumer.pull(1, timeout=0.1)] == [4]
    assert [m.acked for m in msgs] == [False, False, False, True]
    assert await consumer.pull(5, timeout=0.1) == []
    assert nc.requests == [4, 5]


async def test_pull_expired_request_acked_asked_again():
    first = FakeMsg(1, _bytes("g1"))
    consumer, nc = _consumer([[first, _status("408", "Request Timeout")]])
    assert [p.seq for p in await consumer.pull(4, timeout=0.1)] == [1]
    assert first.acked
    assert await consumer.pull(3, timeout=0.1) == []
    assert nc.requests == [4, 3] and not consumer._broken


async def test_pull_other_status_marks_broken():
    consumer, nc = _consumer([[_status("409", "Consumer Deleted")]])
    assert await consumer.pull(2, timeout=0.1) == []
    assert consumer._broken and nc.requests == [2]


async def test_pull_garbage_payload_pulled_with_error_not_raised():
    consumer, _ = _consumer([[FakeMsg(7, b"\xff\xfe not a protobuf", delivery=1)]])
    [p] = await consumer.pull(1, timeout=0.1)
    assert (p.seq, p.group, p.data) == (7, None, b"\xff\xfe not a protobuf")
    assert p.error.startswith("DecodeError: ")


async def test_pull_delivery_gap_keeps_run_before_it_marks_broken():
    # deliveries 1, 2, then 4: delivery 3 was lost on the way
    msgs = [FakeMsg(10, _bytes("a"), 1), FakeMsg(12, _bytes("b"), 2), FakeMsg(15, _bytes("c"), 4)]
    consumer, _ = _consumer([msgs])
    got = await consumer.pull(3, timeout=0.1)
    assert [p.seq for p in got] == [10, 12]
    assert [m.acked for m in msgs] == [False, True, False]  # never past the gap
    assert consumer._broken and consumer._last_seq == 12


async def test_pull_redelivery_marks_broken_acks_nothing():
    msgs = [FakeMsg(3, _bytes("a"), 1, delivered=2)]
    consumer, _ = _consumer([msgs])
    assert await consumer.pull(1, timeout=0.1) == []
    assert consumer._broken and not msgs[0].acked


def test_header_safe_one_printable_ascii_line():
    assert header_safe("a\r\nb\tc  é") == "a b c \\xe9"
    assert len(header_safe("x" * 5000)) == 1000
