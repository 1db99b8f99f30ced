"""The rollout's pure group decision (services.rollout.filters)."""

from __future__ import annotations

import pytest

from asyncrl.errors import SpecError
from asyncrl.types import RewardStatus, Sample
from services.rollout.filters import GroupStatus, decide, failed_samples


def _s(reward: float, ok: bool = True, reason: str = "") -> Sample:
    return Sample(
        output_ids=[1],
        logprobs=[-0.1],
        versions=[0],
        reward=reward,
        reward_status=RewardStatus.OK if ok else RewardStatus.FAILED,
        reward_reason=reason,
    )


def test_decide_nonconstant_rewards_is_accepted():
    d = decide([_s(1.0), _s(0.0), _s(0.0)], "nonconstant_reward")
    assert d.status is GroupStatus.ACCEPTED and d.publish and d.reason == ""


def test_decide_constant_rewards_is_rejected_with_reason():
    d = decide([_s(1.0), _s(1.0)], "nonconstant_reward")
    assert d.status is GroupStatus.REJECTED and not d.publish
    assert d.reason == "constant reward 1 across 2 scored samples"


def test_decide_constant_ok_rewards_beside_a_failure_is_rejected():
    # the FAILED sample's placeholder 0.0 must not count as a different reward
    d = decide([_s(1.0), _s(1.0), _s(0.0, ok=False, reason="timed out")], "nonconstant_reward")
    assert d.status is GroupStatus.REJECTED
    assert d.reason == "constant reward 1 across 2 scored samples"


def test_decide_filter_none_constant_rewards_is_accepted():
    assert decide([_s(0.0), _s(0.0)], "none").status is GroupStatus.ACCEPTED


def test_decide_eval_group_constant_rewards_is_never_filtered():
    assert (
        decide([_s(0.0), _s(0.0)], "nonconstant_reward", eval_group=True).status
        is GroupStatus.ACCEPTED
    )


@pytest.mark.parametrize("eval_group", [False, True])
def test_decide_all_samples_failed_is_failed_with_first_reason(eval_group):
    d = decide(
        [_s(0.0, ok=False, reason="timed out after 5s"), _s(0.0, ok=False, reason="x")],
        "none",
        eval_group=eval_group,
    )
    assert d.status is GroupStatus.FAILED and not d.publish
    assert d.reason == "all 2 samples failed: timed out after 5s"


def test_decide_unknown_filter_raises_spec_error_naming_the_field():
    with pytest.raises(SpecError, match="rollout.filter: unknown 'top_half'"):
        decide([_s(0.5), _s(0.7)], "top_half")


def test_failed_samples_counts_failed_rewards_only():
    assert failed_samples([_s(1.0), _s(0.0, ok=False), _s(0.0, ok=False)]) == 2
