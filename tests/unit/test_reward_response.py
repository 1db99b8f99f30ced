"""The reward service's response: each result as the keyword constructor would write it."""

from __future__ import annotations

from asyncrl.types import RewardStatus, Score
from asyncrl.v1 import common_pb2, reward_pb2
from services.reward.pool import Item
from services.reward.server import response_to_proto


def test_response_to_proto_ok_and_failed_same_bytes_as_keywords():
    items = [Item("g:0", "12", "12"), Item("g:1", "x", "12"), Item("g:2", "y", "z", "p")]
    scores = [
        Score(1.0),
        Score(0.0),
        Score(0.0, RewardStatus.FAILED, "ValueError: answer has no number: 'z'"),
    ]
    want = reward_pb2.ScoreResponse(
        results=[
            reward_pb2.ScoreResult(id="g:0", reward=1.0, status=common_pb2.REWARD_STATUS_OK),
            reward_pb2.ScoreResult(id="g:1", reward=0.0, status=common_pb2.REWARD_STATUS_OK),
            reward_pb2.ScoreResult(
                id="g:2",
                reward=0.0,
                status=common_pb2.REWARD_STATUS_FAILED,
                reason="ValueError: answer has no number: 'z'",
            ),
        ]
    )
    got = response_to_proto(items, scores)
    assert got == want
    assert got.SerializeToString() == want.SerializeToString()
