"""The fuzzer's short budget (tests/fuzz): every RPC of every service, a few derandomized
hypothesis cases each, against one real server of each service (gRPC on port 0, a real
nats-server, security on) started once for the module; and the trainer's train subject. `make
fuzz` runs the same cases for FUZZ_MINUTES and writes var/fuzz/report.json.

Per RPC case: never INTERNAL or UNKNOWN, INVALID_ARGUMENT names the field, every service still
SERVING, the operator's and another tenant's experiments unchanged (tests/fuzz/props.py). Per
message on the train subject: nothing raises, nothing untrainable is admitted
(tests/fuzz/nats_subjects.py)."""

from __future__ import annotations

import json

import grpc
import pytest

from asyncrl.v1 import trainer_pb2
from asyncrl.v1.common_pb2 import BindExperimentRequest as BindRequest
from tests.fuzz.cluster import FuzzCluster
from tests.fuzz.nats_subjects import NatsFuzz
from tests.fuzz.props import methods, path_of
from tests.fuzz.run import Tally, fuzz_method

pytestmark = pytest.mark.slow  # deploys a (tiny) model: left out of `make test-fast`

CASES = 6
"""Cases per RPC: ~0.1 s each, so a few seconds per service."""
NATS_CASES = 40
RPCS = methods()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = FuzzCluster(tmp_path_factory.mktemp("fuzz")).start()
    yield c
    c.stop()


def test_every_service_has_rpcs_to_fuzz():
    services = {m.containing_service.name for m in RPCS}
    assert services == {"Scheduler", "Rollout", "Reward", "Trainer"}
    assert len(RPCS) >= 24


@pytest.mark.parametrize("method", RPCS, ids=[path_of(m).rsplit(".", 1)[1] for m in RPCS])
def test_fuzz_rpc(cluster, method):
    tally = Tally()
    fuzz_method(cluster, method, CASES, derandomize=True, tally=tally)
    assert tally.cases == CASES
    assert [f.problem for f in tally.findings] == []


def test_fuzz_train_subject_and_ledger(cluster):
    subjects = NatsFuzz(cluster)
    try:
        tally, ledger = Tally(), Tally()
        subjects.fuzz(NATS_CASES, derandomize=True, tally=tally)
        subjects.fuzz_ledger(NATS_CASES, derandomize=True, tally=ledger)
    finally:
        subjects.close()
    assert tally.cases == ledger.cases == NATS_CASES
    assert [f.problem for f in tally.findings + ledger.findings] == []
    assert tally.codes.get("bad", 0) > 0  # the cases reach the dead letters


@pytest.mark.parametrize(
    "experiment_id",
    ["Ä\x03\x9f!jÇö\U000a5f19\x0cz", "../../escape", "a.b.c", "x" * 200],
    ids=["fuzzer-found", "path", "three-tokens", "long"],
)
@pytest.mark.parametrize("service", ["Trainer", "Rollout"])
def test_an_id_no_scheduler_makes_is_refused_naming_it(cluster, service, experiment_id):
    """Found by `make fuzz`: the fuzzer's id reached nats-server as a consumer name and came
    back INTERNAL (ServerError); a path-like one named the trainer's checkpoint directory."""
    method = "StartExperiment" if service == "Trainer" else "BindExperiment"
    request = (trainer_pb2.StartExperimentRequest if service == "Trainer" else BindRequest)(
        experiment_id=experiment_id, spec_json=json.dumps(cluster.spec)
    )
    outcome, _ = cluster.loop.run(
        cluster.call(service, method, "scheduler", request.SerializeToString())
    )
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert outcome.details.startswith("experiment_id: ")
