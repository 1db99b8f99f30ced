"""GroupConsumer.pull over a fake subscription: never more than asked, the surplus of an
over-full fetch handed out next, in stream order; garbage decodes to an error, not a raise."""

from __future__ import annotations

from types import SimpleNamespace

from asyncrl.convert import group_to_bytes
from asyncrl.types import Sample, TrajectoryGroup
from services.trainer.consumer import GroupConsumer, header_safe


class FakeMsg:
    def __init__(self, seq: int, data: bytes):
        self.metadata = SimpleNamespace(sequence=SimpleNamespace(stream=seq))
        self.data = data
        self.acked = False

    async def ack_sync(self, timeout: float) -> None:
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
    assert all(m.acked for m in msgs)  # acked as fetched; the position is the checkpoint's
    second = await consumer.pull(2, timeout=0.1)
    third = await consumer.pull(2, timeout=0.1)
    assert [p.seq for p in second] == [3, 4]
    assert [(p.seq, p.group.group_id) for p in third] == [(5, "g5")]
    assert consumer._sub.fetches == [2]  # the held ones were handed out without a fetch
    assert await consumer.pull(2, timeout=0.1) == []
    assert consumer._sub.fetches == [2, 2]


async def test_pull_garbage_payload_pulled_with_error_not_raised():
    consumer = GroupConsumer(js=None, experiment_id="e")
    consumer._sub = OverFullSub([FakeMsg(7, b"\xff\xfe not a protobuf")])
    [p] = await consumer.pull(1, timeout=0.1)
    assert (p.seq, p.group, p.data) == (7, None, b"\xff\xfe not a protobuf")
    assert p.error.startswith("DecodeError: ")


def test_header_safe_one_printable_ascii_line():
    assert header_safe("a\r\nb\tc  é") == "a b c \\xe9"
    assert len(header_safe("x" * 5000)) == 1000
