"""The trainer's objective, one choice per spec field: advantage estimators, off-policy
corrections, loss aggregation, KL estimators. Pure torch: no I/O, no services; both backends
call the same functions, so they compute the same values.

Shapes follow `algo.PackedBatch`: per-token tensors are [N, T] in target space, `mask` is 1 on
trained output tokens. Notation: `logp` the policy being trained (with grad), `prox` the
trainer's logprobs at the version it trains from (no grad), `behav` the rollout's logprobs
(the behaviour policy, possibly several versions old), `w = exp(prox - behav)` the behaviour
importance weight. All three are log-softmaxes at the sampling temperature (`temperature`).

Safe at the edges: every log-ratio is clamped to +-`LOG_RATIO_BOUND` before `exp` (verl and
slime clamp at 20 too), masks are decided on the log-ratio, and a masked token's weight is set
to 0 with `where` (never `inf * 0`), so any finite logprobs give a finite loss.

A step is built in three parts, so that a backend that runs a minibatch in micro-batches (and
on several data-parallel ranks) gets exactly the full minibatch's loss by summing:

1. `behaviour_correction` (whole batch, no grad): each token's weight `c` and whether it
   counts in the loss normaliser (`norm`); depends on prox and behav only.
2. `aggregation_weights` (per minibatch, no grad): each token's share `g` of the minibatch
   loss; `loss = sum(token_loss * g)`, linear in the tokens.
3. `policy_token_loss` (per micro-batch, with grad): the clipped surrogate of each token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ADVANTAGES = ("grpo", "dr_grpo", "rloo")
CORRECTIONS = ("token_cap", "token_tis", "token_mis", "gspo", "seq_mis", "icepop", "cispo", "m2po")
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "dr_grpo")
KL_ESTIMATORS = ("k1", "k2", "k3")

LOG_RATIO_BOUND = 20.0
"""Every log-ratio (behaviour weight, PPO/GSPO ratio, CISPO's weight, k3) is clamped to
[-20, 20] before `exp`: e^20 ~ 4.9e8 is far past every bound a rule compares with, and far from
float32's overflow at ~e^88. Outside it the ratio is constant (no gradient), as in verl and
slime."""


def safe_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of a log-ratio clamped to +-LOG_RATIO_BOUND: finite for any input but NaN."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


@dataclass(frozen=True)
class LossConfig:
    """The spec's choices for the objective (`trainer.*`), read once by a backend."""

    advantage: str = "grpo"
    correction: str = "token_cap"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    """The upper clip of the PPO ratio, 1 + eps_clip_high (DAPO's clip-higher); None: eps_clip."""
    dual_clip: float | None = None
    """Dual-clip PPO's bound c > 1 on the loss of a negative advantage (Ye et al. 2020)."""
    cap: float | None = 5.0
    """`behav_imp_weight_cap`: the mask bound of token_cap, the truncation of token_tis and
    gspo."""
    cispo_eps_low: float = 1.0
    cispo_eps_high: float = 0.28
    """CISPO's weight is clipped to [1 - eps_low, 1 + eps_high] (eps_low 1: no lower bound)."""
    is_low: float = 0.5
    is_high: float = 2.0
    """Bounds of the masking rules (token_mis, seq_mis, icepop)."""
    m2_bound: float = 0.04
    agg: str = "token_mean"
    agg_constant: float = 1.0
    """Dr.GRPO's constant normaliser (tokens per sample)."""
    masked_in_norm: bool = True
    """Tokens a correction masks stay in the loss normaliser (AReaL, slime); False drops them."""
    temperature: float = 1.0
    """The sampling temperature: logprobs and entropy are those of logits / temperature."""
    kl_estimator: str = "k3"
    kl_coef: float = 0.0
    kl_in: str = "loss"
    entropy_coef: float = 0.0

    @classmethod
    def from_spec(cls, spec) -> LossConfig:
        t = spec.trainer
        return cls(
            advantage=t.advantage,
            correction=t.offpolicy_correction,
            eps_clip=t.eps_clip,
            eps_clip_high=t.eps_clip_high,
            dual_clip=t.dual_clip,
            cap=t.behav_imp_weight_cap,
            cispo_eps_low=t.cispo_eps_low,
            cispo_eps_high=t.cispo_eps_high,
            is_low=t.is_mask_low,
            is_high=t.is_mask_high,
            m2_bound=t.m2po_bound,
            agg=t.loss_agg,
            agg_constant=float(t.loss_agg_constant or spec.rollout.gconfig.max_new_tokens),
            masked_in_norm=t.masked_tokens_in_norm,
            temperature=spec.rollout.gconfig.temperature or 1.0,
            kl_estimator=t.kl_estimator,
            kl_coef=t.kl_coef,
            kl_in=t.kl_in,
            entropy_coef=t.entropy_coef,
        )

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_coef > 0 and self.kl_in == "loss"

    @property
    def kl_in_reward(self) -> bool:
        return self.kl_coef > 0 and self.kl_in == "reward"


# -- advantages ---------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, estimator: str, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of one group's rewards [n] (OK samples only).

    grpo: (r - mean) / (std + eps) (Shao et al. 2024, DeepSeekMath eq. 3) with the
      *population* std (divide by n, as AReaL; verl and SkyRL divide by n - 1, which scales
      every advantage of a group of n by sqrt((n-1)/n));
    dr_grpo: r - mean, no std (Liu et al. 2025, "Understanding R1-Zero-Like Training");
    rloo: r - mean of the *other* samples = n/(n-1) (r - mean) (Ahmadian et al. 2024,
      "Back to Basics").
    A group of one (its siblings FAILED) has no baseline: every estimator gives it 0, so it
    adds no gradient (verl would train on its raw reward). All-equal rewards give 0 too.
    """
    if rewards.numel() == 0:
        return rewards
    centred = rewards - rewards.mean()
    if estimator == "grpo":
        return centred / (rewards.std(unbiased=False) + eps)
    if estimator == "dr_grpo":
        return centred
    if estimator == "rloo":
        n = rewards.numel()
        return centred * (n / (n - 1)) if n > 1 else torch.zeros_like(rewards)
    raise ValueError(f"unknown advantage estimator {estimator!r} (one of {ADVANTAGES})")


def sample_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    ok: torch.Tensor,
    estimator: str,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sample advantages [N] over packed samples: each group's OK samples normalised
    together; a FAILED sample (ok False) gets 0 and no say in its group's statistics."""
    out = torch.zeros_like(rewards)
    for g in group_index.unique().tolist():
        rows = torch.nonzero((group_index == g) & ok).squeeze(-1)
        out[rows] = group_advantages(rewards[rows], estimator, eps)
    return out


# -- KL to the reference ------------------------------------------------------------------------
def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimators of KL(pi || ref) on tokens sampled from pi (Schulman 2020,
    "Approximating KL Divergence"), with log r = ref - logp:
    k1 = -log r; k2 = (log r)^2 / 2; k3 = (r - 1) - log r (unbiased, >= 0), its exp taken of
    log r clamped to +-LOG_RATIO_BOUND."""
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return safe_exp(d) - d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r} (one of {KL_ESTIMATORS})")


# -- off-policy corrections ---------------------------------------------------------------------
@dataclass
class Correction:
    """Per-token outcome of a correction rule (no grad): `weight` multiplies each token's
    surrogate, `norm` marks the tokens the loss normaliser counts (every loss token by
    default, masked ones included; with `masked_in_norm` False a masked token leaves it), and
    `masked` / `truncated` mark the loss tokens the rule masked or whose weight it truncated."""

    weight: torch.Tensor
    norm: torch.Tensor
    masked: torch.Tensor
    truncated: torch.Tensor
    behav_w: torch.Tensor
    """The raw behaviour weight exp(prox - behav) of every token."""

    def rows(self, idx: torch.Tensor | slice) -> Correction:
        """The same rule's outcome on a subset of the rows (a minibatch, a micro-batch)."""
        return Correction(**{k: v[idx] for k, v in vars(self).items()})


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean of x over mask [N, T] -> [N] (0 for a row without tokens)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def m2po_keep(log_w: torch.Tensor, mask: torch.Tensor, bound: float) -> torch.Tensor:
    """M2PO (Zheng et al. 2025, "Prosperity before Collapse", arXiv 2510.01161, Alg. 1): mask
    the tokens with the largest (log w)^2 until the second moment of the rest,
    mean((log w)^2), is at most `bound`. Returns keep [N, T] (1 kept, 0 masked or not a loss
    token). The kept set is the longest prefix of the tokens sorted by (log w)^2 whose mean is
    within the bound (a prefix mean of sorted values only grows)."""
    m2 = (log_w * log_w)[mask > 0]
    order = torch.argsort(m2, stable=True)
    counts = torch.arange(1, m2.numel() + 1, dtype=m2.dtype, device=m2.device)
    prefix_mean = m2[order].cumsum(0) / counts
    n_keep = int((prefix_mean <= bound).sum().item())
    flat = torch.zeros_like(m2)
    flat[order[:n_keep]] = 1.0
    keep = torch.zeros_like(mask, dtype=log_w.dtype)
    keep[mask > 0] = flat
    return keep


def behaviour_correction(
    prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> Correction:
    """Each rule's weight and mask from w = exp(prox - behav) (W: the per-sample geometric
    mean exp(mean_t log w)); tokens outside `mask` get weight and norm 0. w is taken of the
    log-ratio clamped to +-LOG_RATIO_BOUND (finite), and a masked token's weight is set to 0,
    not multiplied by it: an extreme token is masked or truncated, never NaN.

    token_cap: c = w, masked if w > cap (AReaL's decoupled PPO, Fu et al. 2025, 2505.24298);
    token_tis: c = min(w, cap) (truncated IS; Yao et al. 2025, "Your Efficient RL Framework
      Secretly Brings You Off-Policy RL Training");
    token_mis: c = w, masked if w not in [low, high] (masked IS; Liu et al. 2025, "When Speed
      Kills Stability");
    gspo: c = min(W, cap), the sequence-level ratio of GSPO (Zheng et al. 2025, 2507.18071);
    seq_mis: c = W, the whole sample masked if W not in [low, high];
    icepop: c = w if w in [low, high] else 0 (IcePop, Ling Team 2025, Ring-1T: M(k) = k on
      [alpha, beta], 0 outside);
    cispo: c = 1, the weight sits inside the surrogate (`policy_token_loss`);
    m2po: c = w, masked by `m2po_keep`.

    The normaliser (`norm`) counts every loss token, masked ones too (AReaL's and slime's
    convention: a masked token contributes 0, it does not raise its neighbours' weight); with
    `cfg.masked_in_norm` False it counts the kept tokens only (icepop keeps them regardless:
    its rule is a zero weight, not a mask).
    """
    mask = mask.to(prox.dtype)
    log_w = ((prox - behav).detach() * mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    w = torch.exp(log_w)  # finite: at most e^20
    seq_w = torch.exp(seq_mean(log_w, mask)).unsqueeze(-1).expand_as(w)
    ones, zeros = torch.ones_like(w), torch.zeros_like(w)
    cap = math.inf if cfg.cap is None else cfg.cap
    weight, keep, truncated = w, mask > 0, zeros
    rule = cfg.correction
    if rule == "token_cap":
        keep = w <= cap
    elif rule in ("token_tis", "gspo"):
        base = w if rule == "token_tis" else seq_w
        weight = base.clamp(max=cap)
        truncated = (base > cap).to(w.dtype)
    elif rule in ("token_mis", "icepop"):
        keep = (w >= cfg.is_low) & (w <= cfg.is_high)
    elif rule == "seq_mis":
        weight = seq_w
        keep = (seq_w >= cfg.is_low) & (seq_w <= cfg.is_high)
    elif rule == "cispo":
        weight = ones
    elif rule == "m2po":
        keep = m2po_keep(log_w, mask, cfg.m2_bound) > 0
    elif rule not in CORRECTIONS:
        raise ValueError(f"unknown off-policy correction {rule!r} (one of {CORRECTIONS})")
    kept = keep.to(w.dtype) * mask
    counts_masked = cfg.masked_in_norm or rule == "icepop"
    return Correction(
        weight=torch.where(kept > 0, weight, zeros),
        norm=mask if counts_masked else kept,
        masked=mask - kept,
        truncated=truncated * mask,
        behav_w=w,
    )


# -- the surrogate ------------------------------------------------------------------------------
def policy_token_loss(
    logp: torch.Tensor,
    prox: torch.Tensor,
    behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token surrogate loss (before the correction's weight) and where it was clipped.

    PPO (Schulman et al. 2017) against the proximal policy: r = exp(logp - prox),
    loss = max(-A r, -A clip(r, 1 - eps, 1 + eps_high)) (eps_high = eps unless clip-higher,
    Yu et al. 2025, DAPO); with dual clip c (Ye et al. 2020, "Mastering Complex Control in
    MOBA Games") a negative advantage's loss is at most -A c. gspo: r is the sequence ratio
    s = exp(mean_t(logp - prox)) in GSPO-token form, value s and gradient s * dlogp_t
    (Zheng et al. 2025, eq. 11). cispo: loss = -sg(clip(rho, 1 - eps_low, 1 + eps_high)) *
    A * logp with rho = exp(logp - behav) (MiniMax-M1, 2506.13585, eq. 4-5); `clipped` marks
    rho outside the bounds. Every log-ratio is clamped (`safe_exp`).
    """
    mask = mask.to(logp.dtype)
    if cfg.correction == "cispo":
        log_rho = logp.detach() - behav  # clipped to its bounds (within +-LOG_RATIO_BOUND)
        lo = math.log(1.0 - cfg.cispo_eps_low) if cfg.cispo_eps_low < 1 else -math.inf
        hi = math.log(1.0 + cfg.cispo_eps_high)
        weight = torch.exp(log_rho.clamp(lo, hi))
        clipped = ((log_rho < lo) | (log_rho > hi)).to(logp.dtype)
        return -weight * advantages * logp, clipped * mask
    if cfg.correction == "gspo":
        log_s = seq_mean(logp.detach() - prox, mask).unsqueeze(-1)
        ratio = safe_exp(log_s) * torch.exp(logp - logp.detach())
    else:
        ratio = safe_exp(logp - prox)
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    surr1 = -advantages * ratio
    surr2 = -advantages * ratio.clamp(1.0 - cfg.eps_clip, 1.0 + eps_high)
    loss = torch.maximum(surr1, surr2)
    clipped = surr2 > surr1
    if cfg.dual_clip is not None:
        bound = -advantages * cfg.dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        clipped = clipped | dual
    return loss, clipped.to(mask.dtype) * mask


# -- aggregation --------------------------------------------------------------------------------
def aggregation_weights(norm: torch.Tensor, agg: str, constant: float = 1.0) -> torch.Tensor:
    """Each token's share of a minibatch's loss, so that loss = sum(token_loss * weights).

    token_mean: 1 / (tokens in the minibatch) (DAPO's token-level loss, Yu et al. 2025);
    seq_mean_token_sum: 1 / samples; seq_mean_token_mean: 1 / (samples * the sample's tokens)
    (GRPO's original form); dr_grpo: 1 / (samples * constant) (Liu et al. 2025, Dr.GRPO).
    Tokens and samples count what `norm` marks (a sample counts if it has a token): every
    loss token by default, the tokens a correction masked included, so a masked token lowers
    the loss without raising the weight of the tokens kept beside it (`Correction.norm`).
    """
    per_seq = norm.sum(-1, keepdim=True)
    n_tok = max(norm.sum().item(), 1.0)
    n_seq = max((per_seq > 0).sum().item(), 1.0)
    if agg == "token_mean":
        return norm / n_tok
    if agg == "seq_mean_token_sum":
        return norm / n_seq
    if agg == "seq_mean_token_mean":
        return norm / (n_seq * per_seq.clamp(min=1))
    if agg == "dr_grpo":
        return norm / (n_seq * constant)
    raise ValueError(f"unknown loss aggregation {agg!r} (one of {AGGREGATIONS})")


def minibatch_loss(
    logp: torch.Tensor,
    prox: torch.Tensor,
    behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    corr: Correction,
    share: torch.Tensor,
    cfg: LossConfig,
    n_tokens: float,
    ref: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of a minibatch, or of a part of it whose tensors (`corr` and `share` included)
    are sliced to the same rows: sum(surrogate * c * share) + kl_coef * KL - entropy_coef * H,
    KL and H token means over the minibatch's `n_tokens` loss tokens (KL only with
    `kl_in` loss and a reference). Parts of one minibatch add up to the whole.

    Returns (loss, parts): loss, clipped (surrogate-clipped tokens among the normaliser's),
    kl and entropy (their shares of the means)."""
    mask = mask.to(logp.dtype)
    token, clipped = policy_token_loss(logp, prox, behav, advantages, mask, cfg)
    loss = (token * corr.weight * share).sum()
    kl = torch.zeros((), dtype=loss.dtype, device=loss.device)
    if ref is not None and cfg.kl_in_loss:
        kl = (kl_estimate(logp, ref, cfg.kl_estimator) * mask).sum() / n_tokens
        loss = loss + cfg.kl_coef * kl
    ent = torch.zeros_like(kl)
    if entropy is not None:
        ent = (entropy * mask).sum() / n_tokens
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
    parts = {
        "loss": loss.item(),
        "clipped": (clipped * corr.norm).sum().item(),
        "kl": kl.item(),
        "entropy": ent.item(),
    }
    return loss, parts


def kl_reward_penalty(
    prox: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-sample KL summed over its trained tokens [N], for `kl_in: reward`: the reward
    becomes r - kl_coef * sum_t kl_t, the sequence sum of per-token rewards
    -kl_coef * kl_t (Ouyang et al. 2022, eq. 2; verl's `apply_kl_penalty` with an outcome
    estimator), at the policy the samples train from (prox)."""
    return (kl_estimate(prox, ref, estimator) * mask.to(prox.dtype)).sum(-1)


# -- diagnostics --------------------------------------------------------------------------------
DIAG_SUMS = ("loss_tokens", "behav_w_sum", "masked", "truncated", "mismatch_tokens", "diff_sum")
DIAG_MAXES = ("behav_w_max", "diff_max")


def diagnostic_sums(
    corr: Correction,
    prox: torch.Tensor,
    behav: torch.Tensor,
    mask: torch.Tensor,
    versions: torch.Tensor,
    version: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums, maxes) over a batch's loss tokens, named by DIAG_SUMS and DIAG_MAXES (float64,
    so data-parallel ranks can all-reduce them): the behaviour weights, the tokens the rule
    masked or truncated, and |prox - behav| over the tokens generated at `version`, the one
    the trainer trains from (same weights: any gap is the engines' numerics or a broken
    weight sync)."""
    mask = mask.to(prox.dtype)
    at_v = mask * (versions == version).to(prox.dtype)
    diff = (prox - behav).abs() * at_v
    sums = torch.stack(
        [
            mask.sum(),
            (corr.behav_w * mask).sum(),
            corr.masked.sum(),
            corr.truncated.sum(),
            at_v.sum(),
            diff.sum(),
        ]
    )
    maxes = torch.stack([(corr.behav_w * mask).max(), diff.max()])
    return sums.double(), maxes.double()


def diagnostics(sums: torch.Tensor, maxes: torch.Tensor) -> dict[str, float]:
    """The backend metrics of `diagnostic_sums` (after any all-reduce)."""
    s = dict(zip(DIAG_SUMS, sums.tolist(), strict=True))
    m = dict(zip(DIAG_MAXES, maxes.tolist(), strict=True))
    tokens = max(s["loss_tokens"], 1.0)
    return {
        "behav_weight_mean": s["behav_w_sum"] / tokens,
        "behav_weight_max": m["behav_w_max"],
        "is_masked_fraction": s["masked"] / tokens,
        "is_truncated_fraction": s["truncated"] / tokens,
        "logprob_diff_mean": s["diff_sum"] / max(s["mismatch_tokens"], 1.0),
        "logprob_diff_max": m["diff_max"],
        "logprob_diff_tokens": s["mismatch_tokens"],
    }
