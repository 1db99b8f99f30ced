"""Which version `asyncrl export` takes and where it looks for it (asyncrl.export)."""

from __future__ import annotations

import json

import pytest

from asyncrl.errors import BadRequest
from asyncrl.export import sibling_uri, source_of
from asyncrl.v1 import scheduler_pb2


def _exp(uri: str, newest: int = 7, lora: bool = False) -> scheduler_pb2.Experiment:
    spec = {"model": {"path": "/m/base"}, "trainer": {"lora": {"rank": 4} if lora else None}}
    return scheduler_pb2.Experiment(
        id="e-1", spec_json=json.dumps(spec), weights_version=newest, weights_uri=uri
    )


def test_sibling_uri_file_and_nats_same_experiment_other_version():
    assert sibling_uri("file:///var/weights/e-1/v000007", 3) == "file:///var/weights/e-1/v000003"
    assert (
        sibling_uri("nats-obj://asyncrl_weights/e-1/v000007", 3)
        == "nats-obj://asyncrl_weights/e-1/v000003"
    )


def test_source_of_default_newest_committed_version():
    src = source_of(_exp("file:///w/e-1/v000007", lora=True), None)
    assert (src.version, src.uri, str(src.base), src.lora) == (
        7,
        "file:///w/e-1/v000007",
        "/m/base",
        True,
    )
    assert source_of(_exp("file:///w/e-1/v000007"), 0).uri == ""  # v0: the base itself


@pytest.mark.parametrize("version", [-1, 8])
def test_source_of_version_not_reached_refused(version):
    with pytest.raises(BadRequest, match="versions 0..7"):
        source_of(_exp("file:///w/e-1/v000007"), version)
