"""GroupConsumer.pull over a fake subscription: never more than asked, the surplus of an
over-full fetch handed out next, in stream order; garbage decodes to an error, not a raise;
one ack per fetch, never past a delivery that did not arrive."""

from __future__ import annotations

from types import SimpleNamespace

from asyncrl.convert import group_to_bytes
from asyncrl.types import Sample, TrajectoryGroup
from services.trainer.consumer import GroupConsumer, header_safe


class FakeMsg:
    def __init__(self, seq: int, data: bytes, delivery: int | None = None, delivered: int = 1):
        sequence = SimpleNamespace(stream=seq, consumer=seq if delivery is None else delivery)
        self.metadata = SimpleNamespace(sequence=sequence, num_delivered=delivered)
        self.data = data
        self.acked = False

    async def ack(self) -> None:
        self.acked = True


class OverFullSub:
    """A fetch that returns everything it holds, whatever the batch asked (as nats-py does
    when a pull request left over from a timed-out fetch filled its queue)."""

    def __init__(self, msgs: list[FakeMsg]):
        self.msgs = msgs
        self.fetches: list[int] = []

    async def fetch(self, n: int, timeout: float) -> list[FakeMsg]:
        self.fetches.append(n)
        out, self.msgs = self.msgs, []
        return out


def _bytes(gid: str) -> bytes:
    g = TrajectoryGroup("e", gid, "p", "q", "a", [1], [Sample([2], [-1.0], [0])])
    return group_to_bytes(g)


async def test_pull_fetch_returns_more_than_asked_hands_n_keeps_rest_in_order():
    msgs = [FakeMsg(seq, _bytes(f"g{seq}")) for seq in range(1, 6)]
    consumer = GroupConsumer(js=None, experiment_id="e")
    consumer._sub = OverFullSub(msgs)

    first = await consumer.pull(2, timeout=0.1)
    assert [p.seq for p in first] == [1, 2]
    assert consumer.held == 3
    # one ack (AckPolicy.ALL) for the newest of the fetch; the position is the checkpoint's
    assert [m.acked for m in msgs] == [False, False, False, False, True]
    second = await consumer.pull(2, timeout=0.1)
    third = await consumer.pull(2, timeout=0.1)
    assert [p.seq for p in second] == [3, 4]
    assert [(p.seq, p.group.group_id) for p in third] == [(5, "g5")]
    assert consumer._sub.fetches == [2]  # the held ones were handed out without a fetch
    assert await consumer.pull(2, timeout=0.1) == []
    assert consumer._sub.fetches == [2, 2]


async def test_pull_garbage_payload_pulled_with_error_not_raised():
    consumer = GroupConsumer(js=None, experiment_id="e")
    consumer._sub = OverFullSub([FakeMsg(7, b"\xff\xfe not a protobuf", delivery=1)])
    [p] = await consumer.pull(1, timeout=0.1)
    assert (p.seq, p.group, p.data) == (7, None, b"\xff\xfe not a protobuf")
    assert p.error.startswith("DecodeError: ")


async def test_pull_delivery_gap_keeps_run_before_it_marks_broken():
    # deliveries 1, 2, then 4: delivery 3 was lost on the way
    msgs = [FakeMsg(10, _bytes("a"), 1), FakeMsg(12, _bytes("b"), 2), FakeMsg(15, _bytes("c"), 4)]
    consumer = GroupConsumer(js=None, experiment_id="e")
    consumer._sub = OverFullSub(msgs)
    got = await consumer.pull(3, timeout=0.1)
    assert [p.seq for p in got] == [10, 12]
    assert [m.acked for m in msgs] == [False, True, False]  # never past the gap
    assert consumer._broken and consumer._last_seq == 12


async def test_pull_redelivery_marks_broken_acks_nothing():
    msgs = [FakeMsg(3, _bytes("a"), 1, delivered=2)]
    consumer = GroupConsumer(js=None, experiment_id="e")
    consumer._sub = OverFullSub(msgs)
    assert await consumer.pull(1, timeout=0.1) == []
    assert consumer._broken and not msgs[0].acked


def test_header_safe_one_printable_ascii_line():
    assert header_safe("a\r\nb\tc  é") == "a b c \\xe9"
    assert len(header_safe("x" * 5000)) == 1000
