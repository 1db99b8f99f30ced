"""The objective (services/trainer/losses.py) against a reference written here in plain NumPy,
float64, from the papers' formulas (not from the project's code), at the edges: a log-ratio of
~100 on one token, every token masked, a group of one, all-equal rewards.

The reference is deliberately naive: loops and explicit formulas, the whole minibatch at once.
Every option of the schema's `trainer` objective (advantage, offpolicy_correction, loss_agg,
kl_estimator, kl_in) is covered; `test_every_objective_option_is_covered` keeps it so."""

from __future__ import annotations

import math
import typing

import numpy as np
import pytest
import torch

from asyncrl.spec import TrainerSpec
from services.trainer.losses import (
    LossConfig,
    aggregation_weights,
    behaviour_correction,
    group_advantages,
    kl_estimate,
    kl_reward_penalty,
    minibatch_loss,
)

CORRECTIONS = ["token_cap", "token_tis", "token_mis", "gspo", "seq_mis", "icepop", "cispo", "m2po"]
AGGREGATIONS = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "dr_grpo"]
ADVANTAGES = ["grpo", "dr_grpo", "rloo"]
KL_ESTIMATORS = ["k1", "k2", "k3"]
KL_PLACES = ["loss", "reward"]


def test_every_objective_option_is_covered():
    fields = {
        "advantage": ADVANTAGES,
        "offpolicy_correction": CORRECTIONS,
        "loss_agg": AGGREGATIONS,
        "kl_estimator": KL_ESTIMATORS,
        "kl_in": KL_PLACES,
    }
    for name, covered in fields.items():
        assert set(typing.get_args(TrainerSpec.model_fields[name].annotation)) == set(covered)


# -- the reference ------------------------------------------------------------------------------
CAP, LOW, HIGH, EPS, M2 = 5.0, 0.5, 2.0, 0.2, 0.04


def ref_m2po_keep(log_w: np.ndarray, mask: np.ndarray, bound: float) -> np.ndarray:
    """M2PO (arXiv 2510.01161, Alg. 1), as a loop: drop the token with the largest (log w)^2
    until the mean of the rest is within the bound."""
    keep = mask > 0
    while keep.any():
        sq = np.where(keep, log_w**2, -1.0)
        if sq[keep].mean() <= bound:
            break
        keep[np.unravel_index(np.argmax(sq), sq.shape)] = False
    return keep


def ref_weights(rule, prox, behav, mask, m2=M2):
    """(c, kept): each token's behaviour-correction weight and whether the rule keeps it."""
    log_w = (prox - behav) * mask
    w = np.exp(log_w)  # float64: exp(99) ~ 1e43, finite
    n = mask.sum(1, keepdims=True)
    seq_w = np.exp(log_w.sum(1, keepdims=True) / np.maximum(n, 1)) * np.ones_like(w)
    kept = mask > 0
    c = w
    if rule == "token_cap":  # AReaL decoupled PPO: w, masked above the cap
        kept = kept & (w <= CAP)
    elif rule == "token_tis":  # truncated IS: min(w, C)
        c = np.minimum(w, CAP)
    elif rule in ("token_mis", "icepop"):  # masked IS / IcePop: w on [low, high], else 0
        kept = kept & (w >= LOW) & (w <= HIGH)
    elif rule == "gspo":  # GSPO: the sequence ratio, truncated
        c = np.minimum(seq_w, CAP)
    elif rule == "seq_mis":  # sequence-level masked IS
        c = seq_w
        kept = kept & (seq_w >= LOW) & (seq_w <= HIGH)
    elif rule == "cispo":  # the weight sits in CISPO's own surrogate
        c = np.ones_like(w)
    elif rule == "m2po":
        kept = ref_m2po_keep(log_w, mask, m2)
    return np.where(kept, c, 0.0), kept


def ref_token_loss(rule, logp, prox, behav, adv, mask, eps_high=EPS, dual=None, cispo=(1.0, 0.28)):
    """Per-token surrogate before the correction's weight."""
    if rule == "cispo":  # MiniMax-M1 eq. 4-5: -sg(clip(rho, 1 - el, 1 + eh)) A log pi
        rho = np.exp(logp - behav)
        return -np.clip(rho, 1 - cispo[0], 1 + cispo[1]) * adv * logp
    if rule == "gspo":  # the sequence ratio s_i = exp(mean_t(logp - prox)) on every token
        n = np.maximum(mask.sum(1, keepdims=True), 1)
        r = np.exp(((logp - prox) * mask).sum(1, keepdims=True) / n) * np.ones_like(logp)
    else:
        r = np.exp(logp - prox)
    loss = np.maximum(-adv * r, -adv * np.clip(r, 1 - EPS, 1 + eps_high))
    if dual is not None:  # dual clip (Ye et al. 2020): A < 0 loses at most -A c
        loss = np.where(adv < 0, np.minimum(loss, -adv * dual), loss)
    return loss


def ref_aggregate(token_loss, counted, agg, constant=4.0):
    """The minibatch loss from per-token losses (already weighted) and the tokens the
    normaliser counts."""
    samples = [i for i in range(counted.shape[0]) if counted[i].sum() > 0]
    if agg == "token_mean":
        return (token_loss * counted).sum() / max(counted.sum(), 1)
    if agg == "seq_mean_token_sum":
        return sum((token_loss[i] * counted[i]).sum() for i in samples) / max(len(samples), 1)
    if agg == "seq_mean_token_mean":
        per = [(token_loss[i] * counted[i]).sum() / counted[i].sum() for i in samples]
        return sum(per) / max(len(per), 1)
    if agg == "dr_grpo":
        return (token_loss * counted).sum() / (max(len(samples), 1) * constant)
    raise AssertionError(agg)


def ref_loss(rule, agg, logp, prox, behav, adv, mask, masked_in_norm=True, **kw):
    c, kept = ref_weights(rule, prox, behav, mask)
    counted = mask if (masked_in_norm or rule == "icepop") else kept.astype(float) * mask
    token = ref_token_loss(rule, logp, prox, behav, adv, mask, **kw) * c
    return ref_aggregate(token, counted, agg)


# -- the project's pipeline ---------------------------------------------------------------------
def project_loss(rule, agg, logp, prox, behav, adv, mask, dtype=torch.float32, **kw):
    def t(x):
        return torch.tensor(x, dtype=dtype)

    cfg = LossConfig(correction=rule, agg=agg, agg_constant=4.0, **kw)
    corr = behaviour_correction(t(prox), t(behav), t(mask), cfg)
    share = aggregation_weights(corr.norm, agg, cfg.agg_constant)
    loss, _ = minibatch_loss(
        t(logp), t(prox), t(behav), t(adv), t(mask), corr, share, cfg, n_tokens=mask.sum()
    )
    return loss.item(), corr


def batch(extreme: bool = False):
    """Two samples (4 and 2 loss tokens), mild off-policy gaps; `extreme`: one token of sample 0
    has prox -1, behav -100 (log-ratio 99: exp overflows float32)."""
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=float)
    prox = np.array([[-1.0, -0.7, -2.0, -0.4], [-1.3, -0.2, 0.0, 0.0]])
    behav = prox - np.array([[0.05, -0.3, 0.6, 0.01], [0.1, -0.02, 0.0, 0.0]]) * mask
    logp = prox + np.array([[0.1, -0.05, 0.3, 0.02], [-0.25, 0.01, 0.0, 0.0]]) * mask
    if extreme:
        prox[0, 2], behav[0, 2], logp[0, 2] = -1.0, -100.0, -1.0
    adv = np.array([[1.0] * 4, [-0.5] * 4]) * mask
    return logp, prox, behav, adv, mask


# -- the cases ----------------------------------------------------------------------------------
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("rule", CORRECTIONS)
def test_loss_equals_the_reference(rule, agg):
    args = batch()
    got, _ = project_loss(rule, agg, *args, dtype=torch.float64)
    assert got == pytest.approx(ref_loss(rule, agg, *args), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("rule", ["token_cap", "token_mis", "seq_mis", "m2po"])
def test_masked_tokens_leave_the_normaliser_only_when_asked(rule, agg):
    args = batch(extreme=True)
    got, _ = project_loss(rule, agg, *args, dtype=torch.float64, masked_in_norm=False)
    want = ref_loss(rule, agg, *args, masked_in_norm=False)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("rule", CORRECTIONS)
def test_one_extreme_token_gives_a_finite_loss_with_that_token_masked_or_truncated(rule):
    # float32, as the trainer computes: exp(99) is inf there
    args = batch(extreme=True)
    got, corr = project_loss(rule, "token_mean", *args)
    assert math.isfinite(got)
    assert torch.isfinite(corr.weight).all()
    want = ref_loss(rule, "token_mean", *args)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    if rule in ("token_cap", "token_mis", "icepop", "m2po", "seq_mis"):
        assert corr.weight[0, 2] == 0 and corr.masked[0, 2] == 1
    elif rule in ("token_tis", "gspo"):
        assert corr.weight[0, 2] == CAP and corr.truncated[0, 2] == 1


def test_the_masking_rules_gave_nan_before_the_clamp():
    # what the rules computed before: w = exp(prox - behav) unclamped, then w * keep: inf * 0
    prox, behav = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.0, -100.0]])
    w = torch.exp(prox - behav)
    assert torch.isnan(w * (w <= CAP).float()).any()  # the defect the clamp removes
    corr = behaviour_correction(prox, behav, torch.ones(1, 2), LossConfig(correction="token_cap"))
    assert corr.weight.tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("rule", ["token_cap", "token_mis", "icepop", "m2po", "seq_mis"])
def test_every_token_masked_gives_zero_loss_not_nan(rule, agg):
    logp, prox, behav, adv, mask = batch()
    behav = prox - 50.0 * mask  # every w = e^50 (clamped e^20): above every bound
    got, corr = project_loss(rule, agg, logp, prox, behav, adv, mask)
    assert got == 0.0 and corr.weight.sum() == 0
    assert ref_loss(rule, agg, logp, prox, behav, adv, mask) == 0.0


def test_clip_higher_and_dual_clip_match_the_reference():
    logp, prox, behav, adv, mask = batch()
    logp = prox + np.array([[0.4, -0.5, 1.5, 0.25], [1.6, -0.9, 0, 0]]) * mask  # far ratios
    adv = np.array([[1.0] * 4, [-2.0] * 4]) * mask
    args = (logp, prox, behav, adv, mask)
    for kw, ref_kw in [
        ({"eps_clip_high": 0.28}, {"eps_high": 0.28}),
        ({"dual_clip": 3.0}, {"dual": 3.0}),
        ({"eps_clip_high": 0.28, "dual_clip": 3.0}, {"eps_high": 0.28, "dual": 3.0}),
    ]:
        got, _ = project_loss("token_tis", "token_mean", *args, dtype=torch.float64, **kw)
        assert got == pytest.approx(ref_loss("token_tis", "token_mean", *args, **ref_kw))
    # the dual clip binds here: sample 1's first token has ratio e^1.6 ~ 4.95 > 3 with A < 0
    plain, _ = project_loss("token_tis", "token_mean", *args, dtype=torch.float64)
    dual, _ = project_loss("token_tis", "token_mean", *args, dtype=torch.float64, dual_clip=3.0)
    assert dual < plain


def test_cispo_bounds_match_the_reference_and_default_near_one():
    logp, prox, behav, adv, mask = batch(extreme=True)
    got, _ = project_loss("cispo", "token_mean", logp, prox, behav, adv, mask, dtype=torch.float64)
    want = ref_loss("cispo", "token_mean", logp, prox, behav, adv, mask, cispo=(1.0, 0.28))
    assert got == pytest.approx(want, rel=1e-9)
    assert LossConfig().cispo_eps_high == 0.28 and TrainerSpec().cispo_eps_high == 0.28
    got, _ = project_loss(
        "cispo", "token_mean", logp, prox, behav, adv, mask, dtype=torch.float64,
        cispo_eps_low=0.2, cispo_eps_high=0.2,
    )  # fmt: skip
    want = ref_loss("cispo", "token_mean", logp, prox, behav, adv, mask, cispo=(0.2, 0.2))
    assert got == pytest.approx(want, rel=1e-9)


def test_gspo_aggregates_per_sequence_unless_loss_agg_is_set():
    assert TrainerSpec(offpolicy_correction="gspo").loss_agg == "seq_mean_token_mean"
    set_ = TrainerSpec(offpolicy_correction="gspo", loss_agg="token_mean")
    assert set_.loss_agg == "token_mean"
    assert TrainerSpec().loss_agg == "token_mean"


# -- advantages ---------------------------------------------------------------------------------
def ref_advantages(r: list[float], estimator: str) -> list[float]:
    r = np.asarray(r, dtype=float)
    n = len(r)
    if n == 1:
        return [0.0]  # no baseline: the rule the project states
    if estimator == "grpo":  # population std (divide by n)
        return list((r - r.mean()) / (np.sqrt(((r - r.mean()) ** 2).sum() / n) + 1e-6))
    if estimator == "dr_grpo":
        return list(r - r.mean())
    return [r[i] - np.delete(r, i).mean() for i in range(n)]  # RLOO: the others' mean


@pytest.mark.parametrize("estimator", ADVANTAGES)
@pytest.mark.parametrize(
    "rewards", [[1.0, 0.0, 0.0, 0.0], [0.3, 0.9, -1.2], [1.0], [0.5, 0.5, 0.5], [7.0, 7.0]]
)
def test_advantages_equal_the_reference(estimator, rewards):
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), estimator).tolist()
    assert got == pytest.approx(ref_advantages(rewards, estimator), abs=1e-9)


def test_grpo_uses_the_population_std():
    # [1, 0]: mean 0.5, population std 0.5 -> +-1 (the unbiased std, 0.707, would give +-0.707)
    got = group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), "grpo").tolist()
    assert got == pytest.approx([1.0, -1.0], abs=1e-5)


# -- KL -----------------------------------------------------------------------------------------
def ref_kl(logp: np.ndarray, ref: np.ndarray, estimator: str) -> np.ndarray:
    """Schulman (2020): with r = pi_ref / pi on samples from pi."""
    log_r = ref - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    return np.exp(log_r) - 1 - log_r


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimators_equal_the_reference(estimator):
    logp = np.array([[-1.0, -0.3, -2.5, -0.01]])
    ref = np.array([[-1.2, -0.1, -1.0, -3.0]])
    got = kl_estimate(torch.tensor(logp), torch.tensor(ref), estimator).numpy()
    assert got == pytest.approx(ref_kl(logp, ref, estimator), rel=1e-12)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_is_finite_at_a_log_ratio_of_100(estimator):
    logp, ref = torch.tensor([[-100.0, -1.0]]), torch.tensor([[-1.0, -100.0]])
    kl = kl_estimate(logp, ref, estimator)
    assert torch.isfinite(kl).all()
    if estimator == "k3":  # the clamp: exp(min(99, 20)) - 99 - 1 on the first token
        assert kl[0, 0].item() == pytest.approx(math.exp(20) - 100, rel=1e-6)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("place", KL_PLACES)
def test_kl_in_the_loss_or_the_reward_equals_the_reference(estimator, place):
    logp, prox, behav, adv, mask = batch()
    ref = prox - np.array([[0.2, -0.1, 0.4, 0.0], [0.3, 0.1, 0, 0]])
    if place == "reward":  # a penalty kl_coef * sum_t kl_t on each sample's reward
        got = kl_reward_penalty(
            torch.tensor(prox), torch.tensor(ref), torch.tensor(mask), estimator
        )
        want = (ref_kl(prox, ref, estimator) * mask).sum(1)
        assert got.numpy() == pytest.approx(want, rel=1e-12)
        return
    cfg = LossConfig(correction="token_tis", kl_coef=0.1, kl_estimator=estimator, kl_in="loss")
    t = torch.tensor
    corr = behaviour_correction(t(prox), t(behav), t(mask), cfg)
    share = aggregation_weights(corr.norm, cfg.agg)
    args = (t(logp), t(prox), t(behav), t(adv), t(mask), corr, share, cfg)
    loss, _ = minibatch_loss(*args, n_tokens=mask.sum(), ref=t(ref))
    want = ref_loss("token_tis", "token_mean", logp, prox, behav, adv, mask)
    want += 0.1 * (ref_kl(logp, ref, estimator) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(want, rel=1e-9)


# -- entropy at the sampling temperature ----------------------------------------------------------
def test_entropy_and_logprobs_at_the_sampling_temperature_equal_the_reference():
    from services.trainer.algo import token_entropy, token_logprobs

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 11)) * 3
    targets = rng.integers(0, 11, size=(2, 3))
    temp = 0.7
    z = logits / temp
    logp_all = z - z.max(-1, keepdims=True)
    logp_all = logp_all - np.log(np.exp(logp_all).sum(-1, keepdims=True))
    want_h = -(np.exp(logp_all) * logp_all).sum(-1)
    want_lp = np.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    scaled = torch.tensor(logits) / temp  # what both backends feed these functions
    got_lp = token_logprobs(scaled, torch.tensor(targets)).numpy()
    assert got_lp == pytest.approx(want_lp, abs=1e-5)
    assert token_entropy(scaled).numpy() == pytest.approx(want_h, abs=1e-5)
