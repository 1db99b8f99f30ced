"""Fixtures shared by the end-to-end modules (each module starts its own cluster)."""

from __future__ import annotations

import pytest

from asyncrl.tiny import build_tiny_model
from tests.e2e.experiment import write_task


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """(model dir, train.jsonl, eval.jsonl): a tiny Qwen2 and single-digit additions."""
    root = tmp_path_factory.mktemp("task")
    build_tiny_model(root / "model", hidden_size=32, intermediate_size=64)
    return (root / "model", *write_task(root, n_train=64, n_eval=8))
