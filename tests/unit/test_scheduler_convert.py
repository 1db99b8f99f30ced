"""Scheduler records <-> protobuf and <-> the JSON kept in NATS KV."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from asyncrl.spec import spec_from_json, validate_spec
from asyncrl.ticket import Ticket
from asyncrl.types import EvalResult, StepMetrics
from asyncrl.v1 import common_pb2, scheduler_pb2
from services.scheduler.convert import (
    experiment_to_proto,
    kind_from_proto,
    kind_to_proto,
    progress_to_proto,
    state_to_proto,
    worker_to_proto,
)
from services.scheduler.records import ExperimentRecord, ExperimentState, Progress
from services.scheduler.registry import Registry, WorkerKind

STEP = StepMetrics(
    step=3,
    version=3,
    loss=0.25,
    reward_mean=0.5,
    accuracy=0.75,
    staleness_max=2,
    staleness_mean=0.5,
    clip_fraction=0.125,
    entropy=1.5,
    tokens_per_s=100.0,
    step_time_s=2.0,
    groups=8,
    stale_dropped=1,
    grad_norm=0.75,
    kl=0.0625,
    stale_groups=4,
)
EVAL = EvalResult(version=2, accuracy=0.5, reward_mean=0.25, n_prompts=4, n_samples=8, failed=1)
PROGRESS = Progress(
    version=3,
    accepted=24,
    rejected=5,
    failed=1,
    stale_dropped=2,
    running=3,
    dispatched=35,
    trained_groups=24,
    epoch=1,
    cursor=7,
    rollout_tokens_per_s=12.5,
    requeued=4,
    staleness_max=2,
    stale_groups=4,
)
SPEC = {
    "name": "t",
    "model": {"path": "/m"},
    "dataset": {"path": "/d.jsonl"},
    "trainer": {"total_steps": 5, "lr": 0.001},
}


def record() -> ExperimentRecord:
    return ExperimentRecord(
        id="t-abc123",
        name="t",
        spec=validate_spec(SPEC).model_dump(),
        state=ExperimentState.RUNNING,
        message="ok",
        created_unix_ms=1,
        updated_unix_ms=2,
        progress=PROGRESS,
        history=[STEP],
        evals=[EVAL],
        cursor={"epoch": 1, "position": 7, "requeue": [[0, 2, 1]]},
        inflight=[Ticket(epoch=1, index=3, attempt=0)],
        fleet_uri="file:///w/v3",
        weight_uris={0: "/m", 3: "file:///w/v3"},
        failure_reasons={"reward timeout": 2},
    )


def test_step_metrics_round_trip_every_proto_field():
    assert StepMetrics.from_proto(STEP.to_proto()) == STEP
    names = [f.name for f in common_pb2.StepMetrics.DESCRIPTOR.fields]
    assert [f.name for f in fields(StepMetrics)] == names  # derived from the message


def test_eval_result_round_trip():
    assert EvalResult.from_proto(EVAL.to_proto()) == EVAL


def test_progress_to_proto_carries_counters_last_step_and_evals():
    msg = progress_to_proto(PROGRESS, [StepMetrics(step=1), STEP], [EVAL])
    assert all(getattr(msg, f.name) == getattr(PROGRESS, f.name) for f in fields(Progress))
    assert msg.last_step.step == 3 and msg.evals[0].accuracy == 0.5


@pytest.mark.parametrize("state", list(ExperimentState))
def test_state_to_proto_same_name(state):
    assert scheduler_pb2.ExperimentState.Name(state_to_proto(state)) == f"EXPERIMENT_STATE_{state}"


@pytest.mark.parametrize("kind", list(WorkerKind))
def test_worker_kind_round_trip(kind):
    assert kind_from_proto(kind_to_proto(kind)) == kind


def test_worker_kind_unspecified_is_invalid():
    with pytest.raises(ValueError, match="kind"):
        kind_from_proto(common_pb2.WORKER_KIND_UNSPECIFIED)


def test_record_json_round_trip():
    r = record()
    back = ExperimentRecord.from_json(r.to_json())
    assert back == r
    assert json.loads(r.to_json())["inflight"] == [[1, 3, 0]]  # stored as before: a list
    assert back.state is ExperimentState.RUNNING and back.weight_uris[3] == "file:///w/v3"


def test_experiment_to_proto_with_and_without_history():
    msg = experiment_to_proto(record(), with_history=True)
    assert (msg.id, msg.name, msg.state) == (
        "t-abc123",
        "t",
        scheduler_pb2.EXPERIMENT_STATE_RUNNING,
    )
    spec = spec_from_json(msg.spec_json)
    assert spec.trainer.total_steps == 5 and spec.model.path == "/m"
    assert msg.progress.accepted == 24 and msg.progress.last_step.version == 3
    assert [h.step for h in msg.history] == [3]
    assert len(experiment_to_proto(record()).history) == 0


def test_worker_to_proto_reports_binding_and_load():
    reg = Registry()
    w, _ = reg.register(WorkerKind.ROLLOUT, "h:1", "r1", 4)
    reg.bind(w, "t-abc123")
    w.running, w.groups_done, w.version = 2, 9, 3
    msg = worker_to_proto(w)
    assert (
        msg.kind,
        msg.address,
        msg.name,
        msg.experiment_id,
        msg.running,
        msg.groups_done,
        msg.version,
        msg.capacity,
    ) == (common_pb2.WORKER_KIND_ROLLOUT, "h:1", "r1", "t-abc123", 2, 9, 3, 4)
    assert msg.last_seen_unix > 0
