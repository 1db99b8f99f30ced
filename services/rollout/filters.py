"""The rollout's group decision: accept, reject (dynamic filter) or fail. Pure code.

Seed 001's dynamic filtering: a group whose rewards are all equal carries no GRPO signal
(every advantage is zero), so `nonconstant_reward` rejects it. A rejected group is counted by
the scheduler and frees its admission capacity, so filtering never hangs dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from asyncrl.errors import BadRequest
from asyncrl.types import RewardStatus, Sample

FILTERS = ("none", "nonconstant_reward")
DEFAULT_FILTER = "nonconstant_reward"  # the spec's default (RolloutSpec.filter)


class GroupStatus(StrEnum):
    ACCEPTED = "accepted"  # published for training (or an eval group that was scored)
    REJECTED = "rejected"  # dropped by the dynamic filter
    FAILED = "failed"  # reward or generation failed


@dataclass(frozen=True)
class GroupDecision:
    status: GroupStatus
    reason: str = ""

    @property
    def publish(self) -> bool:
        return self.status is GroupStatus.ACCEPTED


def resolve_filter(name: str) -> str:
    """The filter to apply: an empty name (unset on the wire) means the spec's default."""
    name = name or DEFAULT_FILTER
    if name not in FILTERS:
        raise BadRequest("filter", f"unknown filter {name!r} (one of {', '.join(FILTERS)})")
    return name


def decide(samples: list[Sample], filter_name: str, eval_group: bool = False) -> GroupDecision:
    """Decide a scored group's fate.

    - every sample FAILED -> FAILED (the first failure's reason);
    - eval groups are never filtered -> ACCEPTED;
    - `none` -> ACCEPTED;
    - `nonconstant_reward` -> REJECTED when the OK samples' rewards are all equal.
    """
    name = resolve_filter(filter_name)
    ok = [s.reward for s in samples if s.reward_status is RewardStatus.OK]
    if not ok:
        reasons = [s.reward_reason for s in samples if s.reward_reason]
        first = reasons[0] if reasons else "no samples"
        return GroupDecision(GroupStatus.FAILED, f"all {len(samples)} samples failed: {first}")
    if eval_group or name == "none":
        return GroupDecision(GroupStatus.ACCEPTED)
    if len(set(ok)) == 1:
        return GroupDecision(
            GroupStatus.REJECTED, f"constant reward {ok[0]:g} across {len(ok)} scored samples"
        )
    return GroupDecision(GroupStatus.ACCEPTED)


def failed_samples(samples: list[Sample]) -> int:
    return sum(1 for s in samples if s.reward_status is RewardStatus.FAILED)
