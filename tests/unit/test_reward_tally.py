"""The reward service's summary line: its Score calls, items and failed items, every 10 s."""

from __future__ import annotations

import json
import time

from structlog.testing import capture_logs

from asyncrl.types import RewardStatus, Score
from asyncrl.v1 import common_pb2, reward_pb2
from services.reward.fair import FairSlots
from services.reward.server import RewardService

SPEC = {
    "model": {"path": "unused"},
    "dataset": {"path": "unused.jsonl"},
    "reward": {"function": "exact_match", "timeout_s": 5.0},
}


class FakePool:
    """Scores an item OK (1.0) unless its completion is "bad"."""

    slots = FairSlots(1)

    async def score(self, function, kwargs, items, timeout_s, key, deadline):
        return [
            Score(0.0, RewardStatus.FAILED, "scripted") if i.completion == "bad" else Score(1.0)
            for i in items
        ]


class NoDeadline:
    """The gRPC context of a call without a deadline."""

    def time_remaining(self):
        return None


def _request(*completions: str) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(
        experiment_id="exp1",
        items=[
            reward_pb2.ScoreItem(id=str(i), completion=c, answer="1")
            for i, c in enumerate(completions)
        ],
    )


async def test_score_calls_over_10_s_give_one_scored_line_with_calls_items_failed(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    service = RewardService(FakePool())
    await service.BindExperiment(
        common_pb2.BindExperimentRequest(experiment_id="exp1", spec_json=json.dumps(SPEC)), None
    )
    with capture_logs() as logs:
        now[0] = 101.0
        await service.Score(_request("1", "1", "bad"), NoDeadline())
        now[0] = 110.5
        await service.Score(_request("1", "1"), NoDeadline())
    assert [line for line in logs if line["event"] == "scored"] == [
        {
            "event": "scored",
            "log_level": "info",
            "calls": 2,
            "items": 5,
            "failed": 1,
            "seconds": 10.5,
        }
    ]
