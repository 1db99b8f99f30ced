"""The objective's choices (services/trainer/losses.py) against numbers computed by hand from
each method's defining formula; the paper or reference is cited beside each case."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from asyncrl.spec import TrainerSpec, json_schema
from services.trainer.losses import (
    ADVANTAGES,
    AGGREGATIONS,
    CORRECTIONS,
    KL_ESTIMATORS,
    LossConfig,
    aggregation_weights,
    behaviour_correction,
    diagnostic_sums,
    diagnostics,
    group_advantages,
    kl_estimate,
    kl_reward_penalty,
    m2po_keep,
    minibatch_loss,
    policy_token_loss,
    sample_advantages,
)

LN = math.log
F64 = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# -- the spec lists exactly the choices the trainer implements --------------------------------
@pytest.mark.parametrize(
    ("field", "names"),
    [
        ("advantage", ADVANTAGES),
        ("offpolicy_correction", CORRECTIONS),
        ("loss_agg", AGGREGATIONS),
        ("kl_estimator", KL_ESTIMATORS),
    ],
)
def test_spec_choices_are_the_implemented_ones_and_in_the_schema(field, names):
    assert typing.get_args(TrainerSpec.model_fields[field].annotation) == names
    assert json_schema()["$defs"]["TrainerSpec"]["properties"][field]["enum"] == list(names)


def test_spec_defaults_keep_todays_objective():
    spec = TrainerSpec()
    assert (spec.advantage, spec.offpolicy_correction, spec.loss_agg) == (
        "grpo",
        "token_cap",
        "token_mean",
    )
    assert (spec.kl_estimator, spec.kl_in, spec.entropy_coef) == ("k3", "loss", 0.0)


# -- advantages -------------------------------------------------------------------------------
# rewards [1, 0, 0, 0]: mean 0.25, population std sqrt(0.1875) = sqrt(3)/4
def test_grpo_advantage_divides_by_population_std():
    # DeepSeekMath (Shao et al. 2024) eq. 3: (r - mean) / std -> [sqrt 3, -1/sqrt 3 x3]
    s3 = math.sqrt(3)
    got = group_advantages(t([1.0, 0.0, 0.0, 0.0]), "grpo", eps=0.0)
    assert got.tolist() == pytest.approx([s3, -1 / s3, -1 / s3, -1 / s3], rel=1e-12)


def test_dr_grpo_advantage_is_mean_centred_without_std():
    # Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): r - mean
    got = group_advantages(t([1.0, 0.0, 0.0, 0.0]), "dr_grpo")
    assert got.tolist() == [0.75, -0.25, -0.25, -0.25]


def test_rloo_advantage_subtracts_the_mean_of_the_others():
    # RLOO (Ahmadian et al. 2024): r_i - mean_{j != i} r_j: 1 - 0 = 1; 0 - 1/3 = -1/3
    got = group_advantages(t([1.0, 0.0, 0.0, 0.0]), "rloo")
    assert got.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], rel=1e-12)
    assert group_advantages(t([3.0]), "rloo").tolist() == [0.0]  # no other sample: no baseline


def test_sample_advantages_per_group_failed_samples_get_zero_and_no_say():
    # group 0: OK rewards [1, 0] (the FAILED middle one excluded) -> rloo [1, -1], FAILED 0;
    # group 1: [2, 4, 6] -> others' means 5, 4, 3 -> [-3, 0, 3]
    rewards = t([1.0, 9.0, 0.0, 2.0, 4.0, 6.0])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    ok = torch.tensor([True, False, True, True, True, True])
    got = sample_advantages(rewards, group, ok, "rloo")
    assert got.tolist() == pytest.approx([1.0, 0.0, -1.0, -3.0, 0.0, 3.0], abs=1e-12)


# -- corrections ------------------------------------------------------------------------------
# Two samples, behaviour weights w = exp(prox - behav) chosen through their logs:
#   row 0: w = [1, 4, 1/4], all trained        -> geometric mean W0 = exp(0) = 1
#   row 1: w = [2, 8, (pad)], mask [1, 1, 0]     -> W1 = exp((ln 2 + ln 8) / 2) = 4
# cap 5, masking bounds [0.5, 2].
W = [[1.0, 4.0, 0.25], [2.0, 8.0, 1.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def _correct(rule: str, **kw) -> tuple:
    prox = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    behav = prox - t([[LN(x) for x in row] for row in W])
    cfg = LossConfig(**({"correction": rule, "cap": 5.0, "is_low": 0.5, "is_high": 2.0} | kw))
    c = behaviour_correction(prox, behav, t(MASK), cfg)
    return c.weight.tolist(), c.norm.tolist(), c.masked.sum().item(), c.truncated.sum().item()


class _approx:  # noqa: N801 - reads as pytest.approx, for nested lists too
    """Equal to a number or (nested) list within 1e-12."""

    def __init__(self, want):
        self.want = want

    def __eq__(self, got) -> bool:
        return torch.allclose(t(got), t(self.want), rtol=1e-12, atol=1e-12)

    def __repr__(self) -> str:
        return f"approx({self.want})"


def test_token_cap_masks_weights_above_the_cap():
    # AReaL decoupled PPO (Fu et al. 2025, arXiv 2505.24298): w = 8 > 5 masked; it stays in
    # the normaliser (AReaL's convention), or leaves it with masked_in_norm False
    weight, norm, masked, truncated = _correct("token_cap")
    assert weight == _approx([[1, 4, 0.25], [2, 0, 0]])
    assert norm == MASK
    assert (masked, truncated) == (1.0, 0.0)
    _, norm, _, _ = _correct("token_cap", masked_in_norm=False)
    assert norm == [[1, 1, 1], [1, 0, 0]]


def test_token_tis_truncates_the_weight_at_the_cap():
    # truncated IS (Yao et al. 2025, "...Secretly Brings You Off-Policy RL Training"): min(w, 5)
    weight, norm, masked, truncated = _correct("token_tis")
    assert weight == _approx([[1, 4, 0.25], [2, 5, 0]])
    assert norm == MASK
    assert (masked, truncated) == (0.0, 1.0)


def test_token_mis_masks_weights_outside_the_bounds():
    # masked IS (Liu et al. 2025, "When Speed Kills Stability"): 4, 1/4 and 8 fall outside
    # [0.5, 2] -> no loss (in the normaliser unless masked_in_norm False); 1 and 2 keep their
    # weight
    weight, norm, masked, _ = _correct("token_mis")
    assert weight == _approx([[1, 0, 0], [2, 0, 0]])
    assert norm == MASK
    assert masked == 3.0
    _, norm, _, _ = _correct("token_mis", masked_in_norm=False)
    assert norm == [[1, 0, 0], [1, 0, 0]]


def test_gspo_uses_the_geometric_mean_weight_per_sample():
    # GSPO (Zheng et al. 2025, arXiv 2507.18071): sequence ratio = geometric mean of the token
    # ratios: W0 = 1, W1 = 4 (< cap 5: not truncated), on every trained token of the sample
    weight, norm, masked, truncated = _correct("gspo")
    assert weight == _approx([[1, 1, 1], [4, 4, 0]])
    assert norm == MASK
    assert (masked, truncated) == (0.0, 0.0)
    weight, _, _, truncated = _correct("gspo", cap=3.0)
    assert weight == _approx([[1, 1, 1], [3, 3, 0]]) and truncated == 2.0  # W1 = 4 > cap 3


def test_seq_mis_drops_a_sample_whose_geometric_mean_is_out_of_bounds():
    # sample-level masking: W0 = 1 in [0.5, 2] kept (weight W0); W1 = 4 dropped whole
    weight, norm, masked, _ = _correct("seq_mis")
    assert weight == _approx([[1, 1, 1], [0, 0, 0]])
    assert norm == MASK
    assert masked == 2.0
    _, norm, _, _ = _correct("seq_mis", masked_in_norm=False)
    assert norm == [[1, 1, 1], [0, 0, 0]]


def test_icepop_zeroes_out_of_bounds_tokens_but_keeps_them_in_the_normaliser():
    # IcePop (Ling Team 2025, Ring-1T): M(k) = k if 0.5 <= k <= 2 else 0, inside the 1/|y| sum
    weight, norm, masked, _ = _correct("icepop")
    assert weight == _approx([[1, 0, 0], [2, 0, 0]])
    assert norm == MASK
    assert masked == 3.0


def test_cispo_leaves_the_weight_to_the_surrogate():
    weight, norm, masked, truncated = _correct("cispo")
    assert weight == MASK and norm == MASK and (masked, truncated) == (0.0, 0.0)


def test_m2po_masks_the_largest_log_ratios_until_the_second_moment_is_bounded():
    # M2PO (Zheng et al. 2025, arXiv 2510.01161): (log w)^2 of the loss tokens
    # w = 1, 4, 1/4, 2, 8: 0, 1.9218, 1.9218, 0.4805, 4.3241; sorted prefix means
    # 0, 0.2402, 0.8008, 1.0810, 1.7296 -> bound 1.5 masks only w = 8 (the 5th),
    # bound 0.5 keeps w = 1 and 2
    weight, norm, masked, _ = _correct("m2po", m2_bound=1.5, masked_in_norm=False)
    assert norm == [[1, 1, 1], [1, 0, 0]]
    assert weight == _approx([[1, 4, 0.25], [2, 0, 0]])
    assert masked == 1.0
    _, norm, masked, _ = _correct("m2po", m2_bound=0.5, masked_in_norm=False)
    assert norm == [[1, 0, 0], [1, 0, 0]] and masked == 3.0


def test_m2po_keep_keeps_all_when_within_the_bound():
    keep = m2po_keep(t([[0.5, -0.5]]), t([[1.0, 1.0]]), bound=0.25)  # mean 0.25 <= 0.25
    assert keep.tolist() == [[1.0, 1.0]]
    keep = m2po_keep(t([[0.5, -0.5]]), t([[1.0, 1.0]]), bound=0.24)
    assert keep.tolist() == [[0.0, 0.0]]


# -- surrogates -------------------------------------------------------------------------------
def test_gspo_token_surrogate_value_is_the_sequence_ratio_gradient_per_token():
    # GSPO-token (Zheng et al. 2025, eq. 11): s = exp(mean(logp - prox)) = sqrt(1.2 * 1.0);
    # within [0.8, 1.2] with A = 1: loss_t = -s, d loss_t / d logp_t = -s
    prox = t([[-1.0, -2.0]])
    logp = (prox + t([[LN(1.2), 0.0]])).requires_grad_()
    cfg = LossConfig(correction="gspo", eps_clip=0.2)
    loss, clipped = policy_token_loss(logp, prox, prox, t([[1.0, 1.0]]), t([[1.0, 1.0]]), cfg)
    s = math.sqrt(1.2)
    assert loss.tolist() == _approx([[-s, -s]])
    loss.sum().backward()
    assert logp.grad.tolist() == _approx([[-s, -s]])
    assert clipped.tolist() == [[0.0, 0.0]]
    # s = 2 > 1.2 with A = 1: clipped to -1.2, no gradient
    logp2 = (prox + LN(2.0)).requires_grad_()
    loss2, clipped2 = policy_token_loss(logp2, prox, prox, t([[1.0, 1.0]]), t([[1.0, 1.0]]), cfg)
    assert loss2.tolist() == _approx([[-1.2, -1.2]]) and clipped2.tolist() == [[1.0, 1.0]]


def test_cispo_surrogate_is_reinforce_with_a_truncated_stop_gradient_weight():
    # CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): loss_t = -sg(clip(rho, 1 - el, 1 + eh)) *
    # A * logp; with eh = 4 (bound 5), rho = pi/pi_behav = [2, 8], A = [1, -1],
    # logp = [-0.5, -1]: [-2 * 1 * -0.5, -5 * -1 * -1] = [1, -5]; gradient [-2, 5]
    logp = t([[-0.5, -1.0]]).requires_grad_()
    behav = logp.detach() - t([[LN(2.0), LN(8.0)]])
    cfg = LossConfig(correction="cispo", cispo_eps_high=4.0)
    loss, clipped = policy_token_loss(logp, behav, behav, t([[1.0, -1.0]]), t([[1.0, 1.0]]), cfg)
    assert loss.tolist() == _approx([[1.0, -5.0]])
    loss.sum().backward()
    assert logp.grad.tolist() == _approx([[-2.0, 5.0]])
    assert clipped.tolist() == [[0.0, 1.0]]


# -- aggregation ------------------------------------------------------------------------------
# Token losses [[1, 2, 3], [4, -, -]]: 4 tokens in 2 samples (3 and 1 tokens).
@pytest.mark.parametrize(
    ("agg", "want"),
    [
        ("token_mean", (1 + 2 + 3 + 4) / 4),  # DAPO (Yu et al. 2025): sum / tokens = 2.5
        ("seq_mean_token_sum", (6 + 4) / 2),  # mean over samples of each sum = 5
        ("seq_mean_token_mean", (6 / 3 + 4 / 1) / 2),  # GRPO's 1/G sum 1/|o| = 3
        ("dr_grpo", 10 / (2 * 8)),  # Dr.GRPO: sum / (samples x constant 8) = 0.625
    ],
)
def test_aggregation_weights_make_each_mode(agg, want):
    norm = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    token_loss = t([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    share = aggregation_weights(norm, agg, constant=8.0)
    assert (token_loss * share).sum().item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("rule", CORRECTIONS)
def test_minibatch_loss_of_parts_adds_up_to_the_whole(agg, rule):
    """What lets a backend run a minibatch in micro-batches: the parts' losses (and their
    gradients) sum to the whole minibatch's."""
    g = torch.Generator().manual_seed(0)
    shape = (6, 5)
    prox = -torch.rand(shape, generator=g, dtype=F64) * 3
    behav = prox + (torch.rand(shape, generator=g, dtype=F64) - 0.5)
    adv = torch.randn(6, 1, generator=g, dtype=F64).expand(shape)
    mask = (torch.rand(shape, generator=g) < 0.8).to(F64)
    logp = (prox + 0.1 * torch.randn(shape, generator=g, dtype=F64)).requires_grad_()
    ref = prox - 0.2
    cfg = LossConfig(correction=rule, agg=agg, agg_constant=7.0, kl_coef=0.1, entropy_coef=0.01)
    corr = behaviour_correction(prox, behav, mask, cfg)
    share = aggregation_weights(corr.norm, agg, 7.0)
    n_tok = mask.sum().item()
    ent = torch.rand(shape, generator=g, dtype=F64)

    def part(rows):
        loss, _ = minibatch_loss(
            logp[rows], prox[rows], behav[rows], adv[rows], mask[rows], corr.rows(rows),
            share[rows], cfg, n_tokens=n_tok, ref=ref[rows], entropy=ent[rows],
        )  # fmt: skip
        return loss

    whole = part(slice(None))
    (g_whole,) = torch.autograd.grad(whole, logp)
    parts = part(slice(0, 2)) + part(slice(2, 6))
    (g_parts,) = torch.autograd.grad(parts, logp)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(g_parts, g_whole, rtol=1e-12, atol=1e-14)


# -- KL and entropy ---------------------------------------------------------------------------
def test_kl_estimators_match_their_definitions():
    # Schulman 2020, "Approximating KL Divergence", log r = ref - logp:
    # d = -1: k1 = 1, k2 = 0.5, k3 = e^-1 + 1 - 1; d = +1: k1 = -1, k2 = 0.5, k3 = e - 2
    logp, ref = t([-1.0, -2.0]), t([-2.0, -1.0])
    assert kl_estimate(logp, ref, "k1").tolist() == [1.0, -1.0]
    assert kl_estimate(logp, ref, "k2").tolist() == [0.5, 0.5]
    assert kl_estimate(logp, ref, "k3").tolist() == _approx([math.exp(-1), math.e - 2])


def test_kl_reward_penalty_sums_each_samples_trained_tokens():
    # k1 = prox - ref = [[1, 2, (masked 5)], [0.5, 0, 0]] -> sums [3, 0.5]
    prox = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = prox - t([[1.0, 2.0, 5.0], [0.5, 0.0, 0.0]])
    got = kl_reward_penalty(prox, ref, t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), "k1")
    assert got.tolist() == [3.0, 0.5]


def test_minibatch_loss_adds_kl_in_the_loss_and_subtracts_the_entropy_bonus():
    # on-policy, one token, A = 2: surrogate -2; k2 with logp - ref = 1 -> 0.5; entropy 3;
    # loss = -2 + 0.1 * 0.5 - 0.01 * 3 = -1.98
    lp = t([[-1.0]])
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01)
    corr = behaviour_correction(lp, lp, t([[1.0]]), cfg)
    loss, parts = minibatch_loss(
        lp,
        lp,
        lp,
        t([[2.0]]),
        t([[1.0]]),
        corr,
        corr.norm,
        cfg,
        1.0,
        ref=lp - 1,
        entropy=t([[3.0]]),
    )
    assert loss.item() == pytest.approx(-1.98, rel=1e-12)
    assert (parts["kl"], parts["entropy"]) == (0.5, 3.0)
    cfg_reward = LossConfig(kl_coef=0.1, kl_in="reward")  # the KL went into the rewards
    loss, parts = minibatch_loss(
        lp, lp, lp, t([[2.0]]), t([[1.0]]), corr, corr.norm, cfg_reward, 1.0, ref=lp - 1
    )
    assert loss.item() == -2.0 and parts["kl"] == 0.0


# -- diagnostics ------------------------------------------------------------------------------
def test_diagnostics_weights_rule_fractions_and_mismatch_at_the_current_version():
    # token_cap on W/MASK above: weights of the 5 loss tokens 1, 4, 1/4, 2, 8: mean 15.25 / 5,
    # max 8; 1 of 5 masked. Versions: row 0 generated at v3 (the trainer's), row 1 at v2:
    # |prox - behav| over row 0 = |ln 1|, |ln 4|, |ln 1/4| -> mean 2 ln 4 / 3, max ln 4
    prox = t([[-1.0] * 3] * 2)
    behav = prox - t([[LN(x) for x in row] for row in W])
    mask = t(MASK)
    corr = behaviour_correction(prox, behav, mask, LossConfig(cap=5.0))
    versions = torch.tensor([[3, 3, 3], [2, 2, -1]])
    got = diagnostics(*diagnostic_sums(corr, prox, behav, mask, versions, version=3))
    assert got == {
        "behav_weight_mean": _approx(15.25 / 5),
        "behav_weight_max": _approx(8.0),
        "is_masked_fraction": 0.2,
        "is_truncated_fraction": 0.0,
        "logprob_diff_mean": _approx(2 * LN(4) / 3),
        "logprob_diff_max": _approx(LN(4)),
        "logprob_diff_tokens": 3.0,
    }
