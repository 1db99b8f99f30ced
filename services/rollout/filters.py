"""The rollout's group decision: accept, reject (dynamic filter) or fail. Pure code.

Seed 001's dynamic filtering: a group whose rewards are all equal carries no GRPO signal
(every advantage is zero), so `nonconstant_reward` rejects it. A rejected group is counted by
the scheduler and frees its admission capacity, so filtering never hangs dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from asyncrl.registry import FILTERS
from asyncrl.types import RewardStatus, Sample


class GroupStatus(StrEnum):
    ACCEPTED = "accepted"  # published for training (or an eval group that was scored)
    REJECTED = "rejected"  # dropped by the dynamic filter
    FAILED = "failed"  # reward or generation failed
    ABORTED = "aborted"  # the scheduler aborted it (AbortGroups) before it was published


@dataclass(frozen=True)
class GroupDecision:
    status: GroupStatus
    reason: str = ""

    @property
    def publish(self) -> bool:
        return self.status is GroupStatus.ACCEPTED


def keep_all(rewards: list[float]) -> str:
    """`none`: every scored group is trained on."""
    return ""


def nonconstant_reward(rewards: list[float]) -> str:
    """`nonconstant_reward`: equal rewards carry no GRPO signal (every advantage is 0)."""
    if len(set(rewards)) == 1:
        return f"constant reward {rewards[0]:g} across {len(rewards)} scored samples"
    return ""


def decide(samples: list[Sample], filter_name: str, eval_group: bool = False) -> GroupDecision:
    """Decide a scored group's fate.

    - every sample FAILED -> FAILED (the first failure's reason);
    - eval groups are never filtered -> ACCEPTED;
    - otherwise the filter (asyncrl.registry.FILTERS) named by the spec: a reason -> REJECTED.
    """
    reject = FILTERS.load(filter_name)
    ok = [s.reward for s in samples if s.reward_status is RewardStatus.OK]
    if not ok:
        reasons = [s.reward_reason for s in samples if s.reward_reason]
        first = reasons[0] if reasons else "no samples"
        return GroupDecision(GroupStatus.FAILED, f"all {len(samples)} samples failed: {first}")
    reason = "" if eval_group else reject(ok)
    return (
        GroupDecision(GroupStatus.REJECTED, reason)
        if reason
        else GroupDecision(GroupStatus.ACCEPTED)
    )


def failed_samples(samples: list[Sample]) -> int:
    return sum(1 for s in samples if s.reward_status is RewardStatus.FAILED)
