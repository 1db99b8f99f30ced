"""GRPO advantages, the decoupled PPO loss and packing, against hand-computed numbers (the
other estimators and KL: test_losses.py)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.types import RewardStatus, Sample, TrajectoryGroup
from services.trainer.algo import pack_groups, ppo_decoupled_loss
from services.trainer.losses import group_advantages

LN = math.log


# -- grpo advantages ------------------------------------------------------------------------
def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages of each row of [groups, n] rewards."""
    return torch.stack([group_advantages(row, "grpo", eps) for row in rewards])


def test_grpo_advantages_two_right_two_wrong_gives_plus_minus_one():
    # mean 0.5, population std 0.5 -> (r - 0.5) / 0.5 = +-1
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    assert adv.tolist() == [[1.0, -1.0, -1.0, 1.0]]


def test_grpo_advantages_one_right_of_four_uses_population_std():
    # mean 0.25; var = (0.75^2 + 3 * 0.25^2) / 4 = 0.1875; std = 0.4330127
    # 0.75 / 0.4330127 = 1.7320508 (= sqrt 3), -0.25 / 0.4330127 = -0.5773503 (= -1/sqrt 3)
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    s3 = math.sqrt(3.0)
    assert adv[0].tolist() == pytest.approx([s3, -1 / s3, -1 / s3, -1 / s3], rel=1e-6)


def test_grpo_advantages_groups_are_normalised_separately():
    # row 0: mean 2, std 1 -> [-1, 1]; row 1: mean 10, std 5 -> [1, -1]
    adv = grpo_advantages(torch.tensor([[1.0, 3.0], [15.0, 5.0]]), eps=0.0)
    assert adv.tolist() == [[-1.0, 1.0], [1.0, -1.0]]


def test_grpo_advantages_constant_group_gives_zeros():
    adv = grpo_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert adv.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


# -- ppo_decoupled_loss ---------------------------------------------------------------------
# Five tokens, eps_clip 0.2, cap 5. Chosen through the logs so that ratio and weight are exact:
#   t  prox  ratio=exp(logp-prox)  w=exp(prox-behav)  A   mask
#   0  -1.0  1.1                   1.0                +1  1   surr1=-1.1 surr2=-1.1      pg=-1.1 not clipped
#   1  -2.0  1.5                   2.0                +2  1   surr1=-3.0 surr2=-2*1.2=-2.4  pg=-2.4 clipped
#   2  -0.5  0.5                   0.5                -1  1   surr1=+0.5 surr2=+1*0.8=0.8  pg=+0.8 clipped
#   3  -1.0  1.0                   10  (> cap: out)   +3  1   surr1=surr2=-3             pg=-3.0
#   4  -1.0  2.0                   1.0                +5  0   (a prompt position)
# With the cap: kept = {0, 1, 2}; the masked token 3 stays in the normaliser (AReaL's
# convention, functional.py): loss = (-1.1*1 + -2.4*2 + 0.8*0.5) / 4 = -5.5 / 4;
# clip_fraction = 2/4; behaviour weight mean over the 4 = (1 + 2 + 0.5 + 10) / 4.
# Without the cap token 3 counts: loss = (-5.5 + -3*10) / 4 = -8.875; clip_fraction = 2/4.
PROX = [-1.0, -2.0, -0.5, -1.0, -1.0]
RATIO = [1.1, 1.5, 0.5, 1.0, 2.0]
WEIGHT = [1.0, 2.0, 0.5, 10.0, 1.0]
ADV = [1.0, 2.0, -1.0, 3.0, 5.0]
MASK = [1.0, 1.0, 1.0, 1.0, 0.0]


def _loss_inputs():
    prox = torch.tensor([PROX], dtype=torch.float64)
    logp = (prox + torch.tensor([[LN(r) for r in RATIO]], dtype=torch.float64)).requires_grad_()
    behav = prox - torch.tensor([[LN(w) for w in WEIGHT]], dtype=torch.float64)
    return logp, prox, behav, torch.tensor([ADV], dtype=torch.float64), torch.tensor([MASK])


def test_ppo_decoupled_loss_with_cap_matches_hand_computation():
    logp, prox, behav, adv, mask = _loss_inputs()
    loss, stats = ppo_decoupled_loss(logp, prox, behav, adv, mask, 0.2, 5.0)
    assert loss.item() == pytest.approx(-5.5 / 4, rel=1e-9)
    assert stats["clip_fraction"] == pytest.approx(2 / 4)
    assert stats["behav_weight_mean"] == pytest.approx(13.5 / 4)
    assert stats["masked_tokens"] == 4.0


def test_ppo_decoupled_loss_gradient_flows_only_through_unclipped_kept_tokens():
    logp, prox, behav, adv, mask = _loss_inputs()
    loss, _ = ppo_decoupled_loss(logp, prox, behav, adv, mask, 0.2, 5.0)
    loss.backward()
    # d/dlogp of -A*ratio*w/4 at token 0 = -1 * 1.1 * 1 / 4; clipped, capped, masked: 0
    assert logp.grad[0].tolist() == pytest.approx([-1.1 / 4, 0.0, 0.0, 0.0, 0.0], abs=1e-12)


def test_ppo_decoupled_loss_without_cap_keeps_heavy_tokens():
    logp, prox, behav, adv, mask = _loss_inputs()
    loss, stats = ppo_decoupled_loss(logp, prox, behav, adv, mask, 0.2, None)
    assert loss.item() == pytest.approx(-8.875, rel=1e-9)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert stats["masked_tokens"] == 4.0


def test_ppo_decoupled_loss_on_policy_is_minus_mean_advantage():
    # logp == prox == behav: ratio 1, weight 1, nothing clipped -> loss = -mean(A) = -(2 - 1) / 2
    lp = torch.tensor([[-0.3, -0.7]])
    loss, stats = ppo_decoupled_loss(
        lp, lp, lp, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), 0.2, 5.0
    )
    assert loss.item() == pytest.approx(-0.5)
    assert stats["clip_fraction"] == 0.0
    assert stats["behav_weight_mean"] == 1.0


# -- pack_groups ----------------------------------------------------------------------------
def _group(prompt_ids, samples, gid="g"):
    return TrajectoryGroup(
        experiment_id="e",
        group_id=gid,
        prompt_id=gid,
        prompt="",
        answer="",
        prompt_ids=prompt_ids,
        samples=samples,
    )


def _packed():
    g1 = _group(
        [10, 11, 12],
        [
            Sample([20, 21], [-0.1, -0.2], [0, 1], reward=1.0),
            Sample([22], [-0.3], [1], reward=0.0),
            Sample(
                [23, 24, 25],
                [-0.4, -0.5, -0.6],
                [1, 1, 1],
                reward=0.0,
                reward_status=RewardStatus.FAILED,
                reward_reason="timeout",
            ),
        ],
        "g1",
    )
    g2 = _group(
        [30, 31],
        [Sample([40], [-0.7], [2], reward=3.0), Sample([41, 42], [-0.8, -0.9], [2, 2], reward=1.0)],
        "g2",
    )
    return pack_groups([g1, g2], pad_id=0, adv_eps=0.0)


def test_pack_groups_output_tokens_sit_at_target_positions():
    b = _packed()
    # T = longest sequence = 3 + 3 = 6; target t predicts input t+1
    assert b.input_ids.tolist() == [
        [10, 11, 12, 20, 21, 0],
        [10, 11, 12, 22, 0, 0],
        [10, 11, 12, 23, 24, 25],
        [30, 31, 40, 0, 0, 0],
        [30, 31, 41, 42, 0, 0],
    ]
    assert b.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
    ]
    assert b.targets.tolist() == [row[1:] for row in b.input_ids.tolist()]
    # output token j of a prompt of length p is target p-1+j
    assert b.loss_mask.tolist() == [
        [0, 0, 1, 1, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0],  # FAILED: no loss tokens
        [0, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
    ]
    sel = b.loss_mask.bool()
    assert b.targets[sel].tolist() == [20, 21, 22, 40, 41, 42]
    assert b.n_tokens == 6


def test_pack_groups_behav_logprobs_versions_advantages_line_up():
    b = _packed()
    sel = b.loss_mask.bool()
    assert b.behav_logp[sel].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.7, -0.8, -0.9])
    assert b.versions[sel].tolist() == [0, 1, 1, 2, 2, 2]
    # g1 OK rewards [1, 0] -> [+1, -1] (the FAILED one is left out of the statistics);
    # g2 rewards [3, 1] -> mean 2, std 1 -> [+1, -1]
    assert b.advantages[sel].tolist() == [1.0, 1.0, -1.0, 1.0, -1.0, -1.0]
    assert b.advantages[2].abs().sum().item() == 0.0
    assert b.rewards.tolist() == [1.0, 0.0, 0.0, 3.0, 1.0]


def test_pack_groups_select_recounts_loss_tokens():
    b = _packed().select(torch.tensor([0, 2]))
    assert b.n_tokens == 2
    assert b.input_ids.shape == (2, 6)


def test_pack_groups_environment_tokens_are_context_without_loss():
    # a two-turn sample: policy 20 21, environment 90 91 (feedback), policy 22
    turns = Sample(
        [20, 21, 90, 91, 22],
        [-0.1, -0.2, 0.0, 0.0, -0.3],
        [0, 0, 1, 1, 1],
        reward=1.0,
        loss_mask=[1, 1, 0, 0, 1],
    )
    plain = Sample([23], [-0.4], [1], reward=0.0)
    b = pack_groups([_group([10, 11], [turns, plain])], pad_id=0, adv_eps=0.0)
    assert b.input_ids.tolist() == [[10, 11, 20, 21, 90, 91, 22], [10, 11, 23, 0, 0, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 1, 1, 0, 0, 1], [0, 1, 0, 0, 0, 0]]
    sel = b.loss_mask.bool()
    assert b.targets[sel].tolist() == [20, 21, 22, 23]
    assert b.behav_logp[sel].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert b.advantages[sel].tolist() == [1.0, 1.0, 1.0, -1.0]
    assert b.n_tokens == 4


def test_lr_at_linear_decays_to_min_ratio_at_last_step():
    from services.trainer.algo import lr_at

    # 5 steps, base 1.0, floor 0.2: the rate falls by (1 - 0.2) / 4 = 0.2 per step
    got = [lr_at(s, 5, 1.0, "linear", 0.2) for s in range(6)]
    assert got == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    assert lr_at(3, 5, 1e-3, "constant", 0.2) == 1e-3
