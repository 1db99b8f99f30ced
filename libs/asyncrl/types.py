"""Domain types that travel between services. Protobuf stops at the edge: see `convert`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class RewardStatus(StrEnum):
    OK = "ok"
    FAILED = "failed"


@dataclass
class Sample:
    """One completion of a prompt. Per-token lists are aligned with `output_ids`."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = "stop"  # stop | length | abort
    reward: float = 0.0
    reward_status: RewardStatus = RewardStatus.OK
    reward_reason: str = ""
    text: str = ""
    loss_mask: list[int] = field(default_factory=list)
    """1 = policy token (trained), 0 = environment token (context only); empty = all 1."""

    def trained_mask(self) -> list[int]:
        return self.loss_mask or [1] * len(self.output_ids)


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

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    def staleness(self, trainer_version: int) -> int:
        """Versions between the start of generation and the version that trains it."""
        return trainer_version - self.start_version
