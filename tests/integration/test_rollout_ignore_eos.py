"""`ignore_eos` through the rollout service: the tokenizer's EOS ends a sample unless the
sampling params ignore it (a real nats-server, reward and rollout servers on port 0, the torch
engine on a tiny model)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from asyncrl.grpcutil import channel
from asyncrl.spec import SamplingParams
from asyncrl.tiny import build_tiny_model
from asyncrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from asyncrl.weights import path_to_uri
from services.reward.server import create_reward
from services.rollout.engine import GenRequest
from services.rollout.server import create_rollout
from services.rollout.torch_engine import TorchEngine

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

MAX_NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("model")
    build_tiny_model(root, seed=0)
    return root


@pytest.fixture
async def stub(nats_server):
    reward, _ = await create_reward(port=0, workers=1, register=False)
    runtime, _ = await create_rollout(nats_server.url, TorchEngine(seed=0), port=0, register=False)
    async with channel(f"127.0.0.1:{runtime.port}", "scheduler") as ch:
        yield rollout_pb2_grpc.RolloutStub(ch), f"127.0.0.1:{reward.port}"
    await runtime.close()
    await reward.close()


async def _greedy_tokens(stub, model, exp: str, ignore_eos: bool, tokenizer=None) -> int:
    """Bind `exp` (greedy, one sample), load the model, generate one group: its token count."""
    stub, reward = stub
    spec = {
        "model": {"path": str(model), **({"tokenizer_path": str(tokenizer)} if tokenizer else {})},
        "dataset": {"path": "unused.jsonl"},
        "rollout": {
            "n_samples": 1,
            "filter": "none",
            "gconfig": {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": ignore_eos},
        },
        "reward": {"function": "exact_match"},
    }
    await stub.BindExperiment(
        common_pb2.BindExperimentRequest(experiment_id=exp, spec_json=json.dumps(spec)), timeout=30
    )
    await stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(experiment_id=exp, version=0, uri=path_to_uri(model)),
        timeout=30,
    )
    summary = await stub.GenerateGroup(
        rollout_pb2.GenerateGroupRequest(
            experiment_id=exp,
            group_id=f"{exp}-g",
            prompt_id="p",
            prompt="1+1=",
            answer="2",
            reward_addresses=[reward],
            epoch=1,
        ),
        timeout=60,
    )
    assert summary.published, summary.reason
    return summary.tokens


async def test_generate_group_ignore_eos_runs_past_the_tokenizers_eos(stub, model, tmp_path):
    # a tokenizer whose EOS is the 4th character the model writes greedily for this prompt
    engine = TorchEngine()
    await engine.start()
    try:
        await engine.load(str(model), 0)
        tok = AutoTokenizer.from_pretrained(str(model))
        params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
        prompt = tok("1+1=", add_special_tokens=False).input_ids
        out = await engine.generate(GenRequest("x", prompt, params))
    finally:
        await engine.stop()
    eos = next(t for t in out.output_ids[3:] if t not in tok.all_special_ids)
    tok.eos_token = tok.convert_ids_to_tokens(eos)
    tok.save_pretrained(str(tmp_path))
    stops_at = out.output_ids.index(eos) + 1
    assert await _greedy_tokens(stub, model, "eos", False, tmp_path) == stops_at < MAX_NEW
    assert await _greedy_tokens(stub, model, "no-eos", True, tmp_path) == MAX_NEW
