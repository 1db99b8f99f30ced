"""The reward service's response: one result per item, in item order, reason only if FAILED."""

from __future__ import annotations

from asyncrl.types import RewardStatus, Score, ScoreItem
from asyncrl.v1 import common_pb2, reward_pb2
from services.reward.server import response_to_proto


def test_response_to_proto_ok_and_failed_same_bytes_as_keywords():
    items = [
        ScoreItem(id="g:0", prompt="", completion="12", answer="12"),
        ScoreItem(id="g:1", prompt="", completion="x", answer="12"),
        ScoreItem(id="g:2", prompt="p", completion="y", answer="z"),
    ]
    scores = [
        Score(reward=1.0),
        Score(reward=0.0),
        Score(
            reward=0.0,
            status=RewardStatus.FAILED,
            reason="ValueError: answer has no number: 'z'",
        ),
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
