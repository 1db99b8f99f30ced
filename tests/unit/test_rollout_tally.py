"""The rollout's summary line: its finished groups by status and their tokens, every 10 s."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from structlog.testing import capture_logs

from asyncrl.tiny import build_char_tokenizer
from asyncrl.types import Completion
from asyncrl.weights import path_to_uri
from services.rollout.engine import Engine
from services.rollout.service import GroupJob, RolloutService

EXP = "exp1"


class FakeEngine(Engine):
    """Answers every request with `max_new_tokens` copies of token 10, at version 0."""

    version = 0

    async def start(self): ...

    async def stop(self): ...

    async def load(self, model_dir, version): ...

    async def update_weights(self, model_dir, version):
        return 0

    async def generate(self, req):
        n = req.params.max_new_tokens
        return Completion(
            output_ids=[10] * n, logprobs=[0.0] * n, versions=[0] * n, finish_reason="length"
        )


class FakeJetStream:
    async def publish(self, subject, payload, headers=None):
        return SimpleNamespace(seq=1, duplicate=False)


def _spec(model_dir) -> str:
    """TwoCalls: 3 policy tokens, the "|" marker, 2 policy tokens a sample (6), rewarded with
    its index (never a constant group)."""
    workflow = "tests.fixtures_plugins.workflows:TwoCalls"
    return json.dumps(
        {
            "model": {"path": str(model_dir)},
            "dataset": {"path": "unused.jsonl"},
            "rollout": {"n_samples": 2, "workflow": {"name": workflow}},
            "reward": {"function": "exact_match"},
        }
    )


async def test_groups_over_10_s_give_one_groups_done_line_by_status_with_tokens(
    tmp_path, monkeypatch
):
    build_char_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    service = RolloutService(FakeEngine(), FakeJetStream(), engine_kind="torch")
    await service.bind(EXP, _spec(tmp_path))
    await service.update_weights(EXP, 0, path_to_uri(tmp_path))
    with capture_logs() as logs:
        for t, group in ((101.0, "g1"), (110.0, "g2")):
            now[0] = t
            await service.generate_group(GroupJob(EXP, group, "p", "1+1=", "2"))
    assert [line for line in logs if line["event"] == "groups_done"] == [
        {
            "component": "rollout",
            "event": "groups_done",
            "log_level": "info",
            "tokens": 24,  # 2 groups of 2 samples of 6
            "accepted": 2,
            "seconds": 10.0,
        }
    ]
