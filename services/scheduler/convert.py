"""Scheduler records <-> protobuf messages (the only place the two meet in this service)."""

from __future__ import annotations

import json
from dataclasses import fields

from asyncrl.errors import BadRequest
from asyncrl.v1 import common_pb2, scheduler_pb2
from services.scheduler.records import (
    EvalResult,
    ExperimentRecord,
    ExperimentState,
    Progress,
    StepMetrics,
)
from services.scheduler.registry import Worker, WorkerKind

_STATE_TO_PB = {
    ExperimentState.PENDING: scheduler_pb2.EXPERIMENT_STATE_PENDING,
    ExperimentState.RUNNING: scheduler_pb2.EXPERIMENT_STATE_RUNNING,
    ExperimentState.COMPLETED: scheduler_pb2.EXPERIMENT_STATE_COMPLETED,
    ExperimentState.FAILED: scheduler_pb2.EXPERIMENT_STATE_FAILED,
    ExperimentState.CANCELLED: scheduler_pb2.EXPERIMENT_STATE_CANCELLED,
}

_KIND_TO_PB = {
    WorkerKind.ROLLOUT: common_pb2.WORKER_KIND_ROLLOUT,
    WorkerKind.REWARD: common_pb2.WORKER_KIND_REWARD,
    WorkerKind.TRAINER: common_pb2.WORKER_KIND_TRAINER,
}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}


def kind_from_proto(kind: int) -> WorkerKind:
    if kind not in _KIND_FROM_PB:
        raise BadRequest("kind", f"unknown worker kind {kind}")
    return _KIND_FROM_PB[kind]


def kind_to_proto(kind: WorkerKind) -> int:
    return _KIND_TO_PB[kind]


def state_to_proto(state: ExperimentState) -> int:
    return _STATE_TO_PB[state]


def progress_to_proto(
    p: Progress,
    history: list[StepMetrics],
    evals: list[EvalResult],
    failure_reasons: dict[str, int] | None = None,
) -> scheduler_pb2.Progress:
    msg = scheduler_pb2.Progress(**{f.name: getattr(p, f.name) for f in fields(Progress)})
    msg.failure_reasons.update(failure_reasons or {})
    if history:
        msg.last_step.CopyFrom(history[-1].to_proto())
    msg.evals.extend(e.to_proto() for e in evals)
    return msg


def experiment_to_proto(
    r: ExperimentRecord, with_history: bool = False
) -> scheduler_pb2.Experiment:
    msg = scheduler_pb2.Experiment(
        id=r.id,
        name=r.name,
        spec_json=json.dumps(r.spec),
        state=state_to_proto(r.state),
        progress=progress_to_proto(r.progress, r.history, r.evals, r.failure_reasons),
        message=r.message,
        created_unix_ms=r.created_unix_ms,
        updated_unix_ms=r.updated_unix_ms,
        tenant=r.tenant,
    )
    if r.weight_uris:
        msg.weights_version = max(r.weight_uris)
        msg.weights_uri = r.weight_uris[msg.weights_version]
    if with_history:
        msg.history.extend(m.to_proto() for m in r.history)
    return msg


def worker_to_proto(w: Worker) -> scheduler_pb2.WorkerInfo:
    return scheduler_pb2.WorkerInfo(
        worker_id=w.worker_id,
        kind=kind_to_proto(w.kind),
        address=w.address,
        name=w.name,
        experiment_id=w.experiment_id or ",".join(w.shared),  # a shared rollout: every one
        running=w.running,
        groups_done=w.groups_done,
        last_seen_unix=w.last_seen_unix,
        version=w.version,
        capacity=w.capacity,
        device=w.device,
    )
