"""Packing groups into padded batches, logprobs, entropy, the learning-rate schedule and the
decoupled PPO objective (the default of `losses`). Pure torch: no I/O, no services.

Conventions. A batch is packed from trajectory groups into padded tensors in *target space*:
position t of every per-token tensor refers to predicting token t+1 of `input_ids`, so the
logits of a causal LM forward pass `logits[:, :-1]` line up with `targets = input_ids[:, 1:]`.
`loss_mask` is 1 exactly where the target is a generated (output) token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from asyncrl.types import RewardStatus, TrajectoryGroup
from services.trainer.losses import (
    LossConfig,
    aggregation_weights,
    behaviour_correction,
    minibatch_loss,
    sample_advantages,
)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probability of each target under `logits` ([b, s, V] and [b, s] -> [b, s])."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def ppo_decoupled_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    behav_imp_weight_cap: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO (AReaL): clip against the proximal policy, reweight by pi_prox/pi_behav.

    ratio = exp(logp - prox); pg = max(-A*ratio, -A*clip(ratio, 1-eps, 1+eps));
    w = exp(prox - behav) (no gradient); tokens with w > cap are masked out;
    loss = sum(pg * w * mask) / sum(mask). Returns (loss, stats). The default objective of
    `losses` (token_cap, token_mean), on one whole minibatch.
    """
    cfg = LossConfig(eps_clip=eps_clip, cap=behav_imp_weight_cap)
    corr = behaviour_correction(prox_logp, behav_logp, mask, cfg)
    share = aggregation_weights(corr.norm, cfg.agg)
    loss, parts = minibatch_loss(
        logp, prox_logp, behav_logp, advantages, mask, corr, share, cfg, n_tokens=1.0
    )
    kept = corr.norm.sum().clamp(min=1)
    stats = {
        "clip_fraction": parts["clipped"] / kept.item(),
        "behav_weight_mean": ((corr.behav_w * corr.norm).sum() / kept).item(),
        "masked_tokens": float(corr.norm.sum().item()),
    }
    return loss, stats


def lr_at(step: int, total_steps: int, base_lr: float, schedule: str, min_lr_ratio: float) -> float:
    """Learning rate of optimizer version `step` (0-based). `constant`, or `linear` decay from
    base_lr at step 0 to base_lr * min_lr_ratio at the last step. Stateless: derived from the
    step count, which every checkpoint holds."""
    if schedule == "constant" or total_steps <= 1:
        return base_lr
    frac = min(step, total_steps - 1) / (total_steps - 1)
    return base_lr * (1.0 - (1.0 - min_lr_ratio) * frac)


@dataclass
class PackedBatch:
    """Groups flattened to samples and padded. All tensors are [N, T-1] in target space,
    except `input_ids` and `attention_mask` ([N, T])."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    versions: torch.Tensor
    rewards: torch.Tensor  # [N]
    n_tokens: int
    group_index: torch.Tensor | None = None  # [N]: which group each sample belongs to
    reward_ok: torch.Tensor | None = None  # [N]: the sample's reward is OK (not FAILED)

    def select(self, idx: torch.Tensor | slice) -> PackedBatch:
        fields = {k: v[idx] for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return PackedBatch(**fields, n_tokens=int(self.loss_mask[idx].sum().item()))

    def with_sample_advantages(self, per_sample: torch.Tensor) -> PackedBatch:
        """The batch with each sample's advantage [N] on all its output tokens (as packed)."""
        outputs = (self.versions >= 0).to(self.advantages.dtype)
        return replace(self, advantages=per_sample.unsqueeze(-1) * outputs)


def pack_groups(
    groups: list[TrajectoryGroup],
    pad_id: int = 0,
    adv_eps: float = 1e-6,
    estimator: str = "grpo",
) -> PackedBatch:
    """Flatten groups to right-padded sequences (prompt + output) with per-token advantages
    (`losses.group_advantages`: grpo, dr_grpo or rloo).

    A sample whose reward FAILED gets zero advantage and no loss tokens (it is excluded, not
    scored as 0). Advantages are normalised over the group's OK samples. Environment tokens
    (`Sample.loss_mask` 0) are context only: no loss.
    """
    seqs, lmask, blogp, vers, rews, gidx, oks = [], [], [], [], [], [], []
    for gi, g in enumerate(groups):
        for s in g.samples:
            ok = s.reward_status == RewardStatus.OK
            p = len(g.prompt_ids)
            seqs.append(list(g.prompt_ids) + list(s.output_ids))
            # target index t predicts token t+1: output token j sits at target p-1+j
            lmask.append([0.0] * (p - 1) + [float(ok and m) for m in s.trained_mask()])
            blogp.append([0.0] * (p - 1) + list(s.logprobs))
            vers.append([-1] * (p - 1) + list(s.versions))
            rews.append(s.reward or 0.0)
            gidx.append(gi)
            oks.append(ok)
    T = max(len(s) for s in seqs)

    def pad(rows, width, value, dtype):
        return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=dtype)

    input_ids = pad(seqs, T, pad_id, torch.long)
    loss_mask = pad(lmask, T - 1, 0.0, torch.float32)
    batch = PackedBatch(
        input_ids=input_ids,
        attention_mask=pad([[1] * len(s) for s in seqs], T, 0, torch.long),
        targets=input_ids[:, 1:].clone(),
        loss_mask=loss_mask,
        behav_logp=pad(blogp, T - 1, 0.0, torch.float32),
        advantages=torch.zeros_like(loss_mask),
        versions=pad(vers, T - 1, -1, torch.long),
        rewards=torch.tensor(rews, dtype=torch.float32),
        n_tokens=int(loss_mask.sum().item()),
        group_index=torch.tensor(gidx, dtype=torch.long),
        reward_ok=torch.tensor(oks, dtype=torch.bool),
    )
    per_sample = sample_advantages(
        batch.rewards, batch.group_index, batch.reward_ok, estimator, adv_eps
    )
    return batch.with_sample_advantages(per_sample)


def unpack_output_logprobs(
    groups: list[TrajectoryGroup], logp: torch.Tensor
) -> list[list[list[float]]]:
    """Per group, per sample, the output tokens' values of a packed [N, T-1] target-space
    tensor (the inverse of `pack_groups` for per-token quantities)."""
    out, row = [], 0
    for g in groups:
        p = len(g.prompt_ids)
        per_sample = []
        for s in g.samples:
            per_sample.append(logp[row, p - 1 : p - 1 + len(s.output_ids)].tolist())
            row += 1
        out.append(per_sample)
    return out
