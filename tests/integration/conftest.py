"""Fixtures the integration tests share."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, the loaded base model, tokenizer) of the tiny model, built once a module."""
    d = tmp_path_factory.mktemp("tiny")
    build_tiny_model(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, model, AutoTokenizer.from_pretrained(d)
