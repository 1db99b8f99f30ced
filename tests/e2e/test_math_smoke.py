"""The math recipe's CPU smoke spec (examples/math/smoke.yaml) through all four services under
`make up`: SmolLM2-135M-Instruct on the committed GSM8K-style problems, two steps. Its samples
come back scored by the recipe's reward (`examples.math.reward:final_answer`: the reward
worker binds the experiment with it, and every sample's reward is that function of its text),
and the ledger is clean."""

from __future__ import annotations

import asyncio
import json
import warnings
from pathlib import Path

import pytest

from asyncrl.cli import load_spec_dict
from asyncrl.client import read_groups, state_name
from asyncrl.types import RewardStatus
from examples.math.reward import final_answer
from examples.smollm2.fetch import fetch
from tests.e2e.experiment import assert_ledger_clean, run_experiment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # deploys a real model
warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "examples" / "math" / "smoke.yaml"
REWARD = "plugin:examples.math.reward:final_answer"


def test_math_smoke_spec_runs_two_steps_scored_by_the_math_reward(cluster):
    model = fetch(ROOT / "var/models/smollm2-135m")
    spec = load_spec_dict(SMOKE, [f"model.path={model}"])
    exp = asyncio.run(run_experiment(cluster.scheduler, spec, timeout=600))
    assert state_name(exp.state) == "COMPLETED", exp.message
    assert exp.progress.version == spec["trainer"]["total_steps"] == 2
    assert_ledger_clean(cluster, exp, batch_size=spec["trainer"]["batch_size"])

    async def groups():
        url = f"nats://127.0.0.1:{cluster.nats_port}"
        return [g async for g in read_groups(exp.id, url)]

    trained = asyncio.run(groups())
    samples = [(g, s) for g in trained for s in g.samples]
    assert len(trained) >= 4 and all(len(g.samples) == 2 for g in trained)
    assert all(s.reward_status is RewardStatus.OK for _, s in samples), samples[0][1]
    assert all(s.reward == final_answer(s.text, g.answer) for g, s in samples)
    data = ROOT / "examples" / "math" / "data" / "train.jsonl"
    assert {g.answer for g in trained} <= {json.loads(row)["answer"] for row in data.open()}
    bound = [e for e in cluster.events("reward", "experiment_bound") if e["experiment"] == exp.id]
    assert bound and all(e["function"] == REWARD for e in bound)
