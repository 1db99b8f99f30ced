"""Fixtures the integration tests share."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.tiny import build_tiny_model
from services.reward.server import create_reward


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, the loaded base model, tokenizer) of the tiny model, built once a module."""
    d = tmp_path_factory.mktemp("tiny")
    build_tiny_model(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, model, AutoTokenizer.from_pretrained(d)


@pytest.fixture
async def reward_address():
    """A real reward service (one scoring process), not registered anywhere: its address."""
    runtime, _ = await create_reward(port=0, workers=1, register=False)
    yield f"127.0.0.1:{runtime.port}"
    await runtime.close()
