"""Fixtures shared by the end-to-end modules: the small task, and the torch cluster the files
in `tests.e2e.shared.FILES` share (the others start their own `cluster`)."""

from __future__ import annotations

import pytest

from asyncrl.tiny import build_tiny_model
from tests.cluster import Cluster
from tests.e2e import shared
from tests.e2e.experiment import write_task


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """(model dir, train.jsonl, eval.jsonl): a tiny Qwen2 and single-digit additions."""
    root = tmp_path_factory.mktemp("task")
    build_tiny_model(root / "model", hidden_size=32, intermediate_size=64)
    return (root / "model", *write_task(root, n_train=64, n_eval=8))


@pytest.fixture
def cluster(request, tmp_path_factory) -> Cluster:
    """The shared torch cluster in its starting shape, its logs read from here on."""
    assert shared.shares(request.node.nodeid), "list the file in tests.e2e.shared.FILES"
    return shared.shared_cluster(lambda: tmp_path_factory.mktemp("var"))


def pytest_runtest_teardown(item, nextitem):
    shared.release_unless_next_shares(nextitem)


def pytest_sessionfinish(session):
    shared.release()
