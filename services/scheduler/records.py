"""The scheduler's domain records: an experiment's progress, steps, evals and everything that is
persisted to NATS KV (as JSON) so a scheduler restart resumes it. A step's and an eval's
fields are those of their proto messages (asyncrl.types derives them).

The persisted record is bounded, whatever the length of the run: the step history and all but
the last evals live in the history log (`history.HistoryLog`), the record keeps the last step,
the last `KEPT` evals and the weight URIs of the last `KEPT` versions."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from enum import StrEnum
from functools import cache

from asyncrl.ticket import Ticket
from asyncrl.types import EvalResult, StepMetrics

KEPT = 32
"""Evals and weight versions the persisted record keeps (a trainer resumes from a recent
checkpoint, and tells where older weights are in StartExperiment); also the most frequent
failure reasons it keeps."""
MAX_REASON = 500


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


RESUMABLE = frozenset({ExperimentState.CANCELLED, ExperimentState.FAILED})
"""The states `asyncrl resume` continues from."""


@dataclass
class GroupCounters:
    """Training groups by outcome: what admission counts (`policy.StalenessManager` is their
    only writer) and what a Progress reports."""

    accepted: int = 0
    rejected: int = 0
    failed: int = 0
    stale_dropped: int = 0
    """Aborted by the scheduler or dropped by the trainer as too stale."""
    requeued: int = 0
    """Re-queued after an infrastructure fault (a failed call, a lost rollout)."""
    running: int = 0
    dispatched: int = 0


@dataclass
class Progress(GroupCounters):
    """What an experiment has done, made in one place (`progress.ProgressBook.progress`) from
    the objects that own each part; persisted with the record, served by GetExperiment."""

    version: int = 0
    """Fleet version: the weights the rollouts serve."""
    trained_groups: int = 0
    epoch: int = 0
    cursor: int = 0
    rollout_tokens_per_s: float = 0.0
    staleness_max: int = 0
    stale_groups: int = 0
    left_over: int = 0
    """Prompts left over when the run ended, as the ledger counts them: groups cancelled in
    flight, prompts re-queued and not dispatched again, accepted groups never trained
    (read from the ledger at the end, `experiments.close_ledger`: the one figure, the final
    message says it too)."""


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
    """Every step of the surviving lineage (memory; persisted in the history log, the record
    holds only the last one)."""
    evals: list[EvalResult] = field(default_factory=list)
    cursor: dict = field(default_factory=dict)
    """DatasetCursor.state()."""
    inflight: list[Ticket] = field(default_factory=list)
    """Tickets in flight when saved: re-dispatched on resume."""
    awaiting: list[Ticket] = field(default_factory=list)
    """Tickets of the newest accepted training groups, which the trainer may still report
    dropped (`Dispatcher.report_dropped` accepts no other id)."""
    cancelled: list[Ticket] = field(default_factory=list)
    """Tickets of the training groups cancelled in flight as the run ended (left over): a
    resume dispatches them again under the same group id (`Scheduler.resume`)."""
    fleet_uri: str = ""
    weight_uris: dict[int, str] = field(default_factory=dict)
    """Weights URI per committed version (to roll the fleet back to a trainer's checkpoint)."""
    failure_reasons: dict[str, int] = field(default_factory=dict)
    tenant: str = ""
    """The submitting token's tenant ("": the operator's; records saved before tenants)."""

    def add_weights(self, version: int, uri: str) -> None:
        """Remember where `version` lives; only the last KEPT versions (and v0) are kept."""
        self.weight_uris[version] = uri
        for old in [v for v in self.weight_uris if 0 < v <= version - KEPT]:
            del self.weight_uris[old]

    def reopen(self, message: str) -> None:
        """A CANCELLED or FAILED run goes on (`Scheduler.resume`): PENDING again, the groups
        cancelled in flight sent first under their own ids (as a restart sends those in
        flight), nothing counted left over any more (the prompts re-queued in the cursor are
        dispatched again as they are)."""
        assert self.state in RESUMABLE, f"{self.id} is {self.state}"
        self.state, self.message = ExperimentState.PENDING, message
        self.inflight = self.cancelled + self.inflight
        self.cancelled = []
        self.progress.left_over = 0

    def add_step(self, step: StepMetrics) -> list[StepMetrics]:
        """Append a step; steps of versions >= its version (a lineage a restarted trainer
        discarded) are removed and returned."""
        discarded = []
        while self.history and self.history[-1].version >= step.version:
            discarded.append(self.history.pop())
        self.history.append(step)
        return discarded

    def to_json(self) -> bytes:
        """The persisted record: O(its bounded fields), whatever the length of `history` and
        `evals` (neither is copied; json.dumps reads the plain fields as they are)."""
        data = {n: getattr(self, n) for n in field_names(type(self)) if n != "history"}
        data["progress"] = flat_dict(self.progress)
        data["inflight"] = [t.to_json() for t in self.inflight]
        data["awaiting"] = [t.to_json() for t in self.awaiting]
        data["cancelled"] = [t.to_json() for t in self.cancelled]
        data["last_step"] = data_or_none(self.history[-1] if self.history else None)
        data["evals"] = [flat_dict(e) for e in self.evals[-KEPT:]]
        top = sorted(self.failure_reasons.items(), key=lambda kv: -kv[1])[:KEPT]
        data["failure_reasons"] = {why[:MAX_REASON]: n for why, n in top}
        return json.dumps(data).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ExperimentRecord:
        raw = json.loads(data)
        raw["state"] = ExperimentState(raw["state"])
        raw["progress"] = build_dataclass(Progress, raw.get("progress", {}))
        last = raw.get("last_step")
        raw["history"] = [build_dataclass(StepMetrics, m) for m in raw.get("history", [])]
        if last and not raw["history"]:  # the rest is in the history log
            raw["history"] = [build_dataclass(StepMetrics, last)]
        raw["evals"] = [build_dataclass(EvalResult, e) for e in raw.get("evals", [])]
        raw["weight_uris"] = {int(k): v for k, v in raw.get("weight_uris", {}).items()}
        for key in ("inflight", "awaiting", "cancelled"):
            raw[key] = [Ticket.from_json(t) for t in raw.get(key, [])]
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


def data_or_none(item) -> dict | None:
    return flat_dict(item) if item is not None else None


@cache
def field_names(cls) -> tuple[str, ...]:
    """A dataclass's field names, in order."""
    return tuple(f.name for f in fields(cls))


def flat_dict(item) -> dict:
    """`dataclasses.asdict` of a dataclass whose fields are scalars (StepMetrics, EvalResult,
    Progress): the same dict, without asdict's recursive deep copy of every value (a
    StepMetrics: 20 CPU-us with asdict, 1.5 this way; one per commit in the history log)."""
    return {name: getattr(item, name) for name in field_names(type(item))}


def build_dataclass(cls, data: dict):
    names = set(field_names(cls))
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
    stop: bool
    """The experiment is over (finished or cancelled): the trainer should stop."""
