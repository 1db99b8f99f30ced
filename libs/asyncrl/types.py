"""Domain types that travel between services, each defined once.

- `Sample`: one sample of a group, from the workflow that builds it turn by turn, through
  scoring and JetStream, to the trainer (`Trajectory` is the name workflows know it by).
- `GroupId`: the id of one dispatch of one training prompt, formatted and parsed here only.
- `Completion`: what one generation returns, from the engine to the workflow that appends it
  to its `Sample`.
- `ScoreItem` and `Score`: what is scored (one completion against its answer) and the reward
  function's verdict on it, wherever it is computed.
- `RewardStatus`, `StepMetrics`, `EvalResult`: the proto messages in `protos/asyncrl/v1` are
  their definition (field docs there); the classes here are derived from the messages' own
  descriptors, so a field added to the message appears here, in the converters and in the
  scheduler's stored history without another edit.
- `TrainerState`: what a trainer reports in `TrainerStatus.state`, read by the scheduler.

Protobuf stops at the edge: `asyncrl.convert` turns these into messages and back.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from asyncrl.v1 import common_pb2, scheduler_pb2


def _enum_from_proto(name: str, enum_type, prefix: str) -> type[StrEnum]:
    """A StrEnum with the proto enum's names minus `prefix` (UNSPECIFIED left out)."""
    names = [n.removeprefix(prefix) for n in enum_type.keys() if not n.endswith("UNSPECIFIED")]
    return StrEnum(name, [(n, n.lower()) for n in names])


RewardStatus = _enum_from_proto("RewardStatus", common_pb2.RewardStatus, "REWARD_STATUS_")
"""OK (the reward is the function's verdict) or FAILED (`reward_reason` says why; never 0)."""


class TrainerState(StrEnum):
    """A trainer's state (`TrainerStatus.state` on the wire)."""

    IDLE = "idle"
    LOADING = "loading"
    WAITING = "waiting"
    TRAINING = "training"
    STOPPED = "stopped"
    FAILED = "failed"

    @classmethod
    def reported(cls, value: str) -> TrainerState:
        """The state a TrainerStatus reports (an unknown one reads as IDLE)."""
        return cls._value2member_map_.get(value, cls.IDLE)

    @property
    def active(self) -> bool:
        """Running an experiment (the scheduler sends such a trainer back to it)."""
        return self in (TrainerState.LOADING, TrainerState.WAITING, TrainerState.TRAINING)


_GROUP_ID = re.compile(r"(?P<experiment>.+)-e(?P<epoch>\d+)-p(?P<index>\d+)-a(?P<attempt>\d+)")


@dataclass(frozen=True)
class GroupId:
    """The id of one dispatch of one training prompt: `<experiment>-e<epoch>-p<index>-a<attempt>`
    (str() formats it, `parse` reads it back). It is the group's Nats-Msg-Id, so a retry of the
    same dispatch keeps it and JetStream keeps one copy; a prompt sampled afresh (dropped as too
    stale) gets the next attempt."""

    experiment_id: str
    epoch: int
    index: int
    """The prompt's row in the dataset."""
    attempt: int = 0

    def __str__(self) -> str:
        return f"{self.experiment_id}-e{self.epoch}-p{self.index}-a{self.attempt}"

    @classmethod
    def parse(cls, text: str) -> GroupId | None:
        """The id `text` formats, or None when it is not a training group's (an eval group's
        `<experiment>-eval-v<version>-p<index>-a<attempt>`, anything else)."""
        m = _GROUP_ID.fullmatch(text)
        if m is None:
            return None
        return cls(
            experiment_id=m["experiment"],
            epoch=int(m["epoch"]),
            index=int(m["index"]),
            attempt=int(m["attempt"]),
        )


_PY_TYPES = {
    FieldDescriptor.TYPE_DOUBLE: float,
    FieldDescriptor.TYPE_FLOAT: float,
    FieldDescriptor.TYPE_INT32: int,
    FieldDescriptor.TYPE_INT64: int,
    FieldDescriptor.TYPE_BOOL: bool,
    FieldDescriptor.TYPE_STRING: str,
}


def _record_from_proto(message: type[Message], doc: str) -> type:
    """A dataclass with the fields of a flat proto message (scalars), zero defaults, plus
    `to_proto()` and `from_proto(msg)`. Field order is the message's."""
    fields = []
    for f in message.DESCRIPTOR.fields:
        py = _PY_TYPES[f.type]
        fields.append((f.name, py, dataclasses.field(default=py())))

    names = tuple(name for name, _, _ in fields)  # scalars: no deep copy as asdict makes

    def to_proto(self) -> Message:
        return message(**{name: getattr(self, name) for name in names})

    def from_proto(cls, msg: Message) -> Any:
        return cls(**{name: getattr(msg, name) for name in names})

    namespace = {"to_proto": to_proto, "from_proto": classmethod(from_proto), "__doc__": doc}
    name = message.DESCRIPTOR.name
    return dataclasses.make_dataclass(name, fields, namespace=namespace)


StepMetrics = _record_from_proto(
    common_pb2.StepMetrics, "One optimizer step as the trainer reports it (asyncrl.v1.StepMetrics)."
)
EvalResult = _record_from_proto(
    scheduler_pb2.EvalResult, "One eval round at a version (asyncrl.v1.EvalResult)."
)


@dataclass
class ScoreItem:
    """One completion to score with the experiment's reward function (Reward.Score's item)."""

    id: str
    """`<group id>:<sample index>`: which sample it is, unique within a Score call."""
    prompt: str
    completion: str
    answer: str


@dataclass
class Score:
    """A reward function's verdict on one completion."""

    reward: float
    status: RewardStatus = RewardStatus.OK
    reason: str = ""
    """Why it FAILED (timed out, what the function raised, an unreachable reward service)."""


@dataclass
class Completion:
    """What one generation returns, from the engine to the workflow: the policy's tokens with
    their behaviour logprobs and the version that produced each (a weight update mid-way shows
    as two versions)."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    """stop | length | abort"""
    text: str = ""
    """The tokens decoded (special tokens skipped); the rollout service sets it, an engine
    leaves it empty."""
    interruptions: int = 0
    """Weight updates the generation was interrupted by (and continued after)."""


@dataclass
class Sample:
    """One sample of a group. Per-token lists are aligned with `output_ids`, the tokens after
    the group's prompt; `loss_mask` marks which of them the policy produced (1, trained) and
    which the environment inserted (0: feedback, tool output; context only). An empty
    `loss_mask` means all 1.

    A workflow builds one with `add_policy` / `add_env`. `reward=None` asks the rollout service
    to score `text` (or, if empty, the decoded policy tokens) with the experiment's reward
    function; a workflow that scored itself sets `reward` (and, on failure,
    `reward_status=FAILED` with a reason)."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Behaviour logprobs (0 for environment tokens)."""
    versions: list[int] = field(default_factory=list)
    """Policy version that produced each token."""
    finish_reason: str = "stop"
    """stop | length | abort"""
    reward: float | None = None
    reward_status: RewardStatus = RewardStatus.OK
    reward_reason: str = ""
    text: str = ""
    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0
    """Policy turns appended (not sent on the wire)."""

    def add_policy(self, c: Completion) -> None:
        """Append a completion: trained tokens."""
        self.loss_mask = self.trained_mask() + [1] * len(c.output_ids)
        self.output_ids += c.output_ids
        self.logprobs += c.logprobs
        self.versions += c.versions
        self.finish_reason = c.finish_reason
        self.turns += 1

    def add_env(self, token_ids: list[int], version: int) -> None:
        """Append environment tokens (feedback, tool output): context for the next turn, no
        loss. They carry the version serving when they were appended and logprob 0."""
        self.loss_mask = self.trained_mask() + [0] * len(token_ids)
        self.output_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [version] * len(token_ids)

    def trained_mask(self) -> list[int]:
        """`loss_mask` with the empty form expanded: one entry per output token."""
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.output_ids)

    @property
    def all_policy(self) -> bool:
        return all(self.trained_mask())

    def score(self, s: Score) -> None:
        """Record a verdict (a FAILED one scores 0 and keeps its reason)."""
        ok = s.status is RewardStatus.OK
        self.reward = s.reward if ok else 0.0
        self.reward_status, self.reward_reason = s.status, s.reason


@dataclass
class TrajectoryGroup:
    """The n samples generated for one prompt: the unit of dispatch, filtering and training."""

    experiment_id: str
    group_id: str
    prompt_id: str
    prompt: str
    answer: str
    prompt_ids: list[int]
    samples: list[Sample] = field(default_factory=list)
    start_version: int = 0
    eval: bool = False
    created_unix_ms: int = 0
    rollout_worker: str = ""
    epoch: int = 0
    fingerprints: dict[int, str] = field(default_factory=dict)
    """Version -> fingerprint of the weights the engine held for it, for each version in the
    samples' `versions` (`asyncrl.fingerprint`; one engine stamps the whole group, so one map
    serves every sample); "" or absent: unverified."""

    @property
    def rewards(self) -> list[float]:
        return [s.reward or 0.0 for s in self.samples]

    def staleness(self, trainer_version: int) -> int:
        """Versions between the start of generation and the version that trains it."""
        return trainer_version - self.start_version
