"""The scheduler's domain records: an experiment's progress, steps, evals and everything that is
persisted to NATS KV (as JSON) so a scheduler restart resumes it. A step's and an eval's
fields are those of their proto messages (asyncrl.types derives them)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum

from asyncrl.types import EvalResult, StepMetrics


class ExperimentState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (
            ExperimentState.COMPLETED,
            ExperimentState.FAILED,
            ExperimentState.CANCELLED,
        )


@dataclass
class Progress:
    version: int = 0
    """Fleet version: the weights the rollouts serve."""
    accepted: int = 0
    rejected: int = 0
    failed: int = 0
    stale_dropped: int = 0
    running: int = 0
    dispatched: int = 0
    trained_groups: int = 0
    epoch: int = 0
    cursor: int = 0
    rollout_tokens_per_s: float = 0.0
    requeued: int = 0
    staleness_max: int = 0
    stale_groups: int = 0


@dataclass
class ExperimentRecord:
    id: str
    name: str
    spec: dict
    """The validated spec (ExperimentSpec.model_dump())."""
    state: ExperimentState = ExperimentState.PENDING
    message: str = ""
    created_unix_ms: int = 0
    updated_unix_ms: int = 0
    progress: Progress = field(default_factory=Progress)
    history: list[StepMetrics] = field(default_factory=list)
    evals: list[EvalResult] = field(default_factory=list)
    cursor: dict = field(default_factory=dict)
    """DatasetCursor.state()."""
    inflight: list[list[int]] = field(default_factory=list)
    """Tickets [epoch, index, attempt] in flight when saved: re-dispatched on resume."""
    fleet_uri: str = ""
    weight_uris: dict[int, str] = field(default_factory=dict)
    """Weights URI per committed version (to roll the fleet back to a trainer's checkpoint)."""
    failure_reasons: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ExperimentRecord:
        raw = json.loads(data)
        raw["state"] = ExperimentState(raw["state"])
        raw["progress"] = _build(Progress, raw.get("progress", {}))
        raw["history"] = [_build(StepMetrics, m) for m in raw.get("history", [])]
        raw["evals"] = [_build(EvalResult, e) for e in raw.get("evals", [])]
        raw["weight_uris"] = {int(k): v for k, v in raw.get("weight_uris", {}).items()}
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


def _build(cls, data: dict):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Event:
    """A Watch event: `step`, `eval` or `state` (snapshots are made by the servicer)."""

    kind: str
    step: StepMetrics | None = None
    eval: EvalResult | None = None


@dataclass
class CommitResult:
    fleet_version: int
    updated: int
    fenced: int
    stop: bool
    """The experiment is over (finished or cancelled): the trainer should stop."""
