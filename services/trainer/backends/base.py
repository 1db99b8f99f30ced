"""The trainer-backend contract: one optimizer version per `train_step`, plus what every backend
shares (packing groups onto its device, the RNG state a checkpoint carries)."""

from __future__ import annotations

import math
import random
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from asyncrl.logging import get_logger
from asyncrl.spec import ExperimentSpec
from asyncrl.types import TrajectoryGroup
from services.trainer.algo import PackedBatch, pack_groups
from services.trainer.losses import (
    Correction,
    LossConfig,
    behaviour_correction,
    diagnostic_sums,
    diagnostics,
    kl_reward_penalty,
    sample_advantages,
)


def finite_bound(dtype: torch.dtype) -> float:
    """The largest weight magnitude a forward in `dtype` keeps finite: sqrt of fp32's max, where
    a product of two such values (an embedding row's square in RMSNorm, q.k, a logit) overflows
    (lr 1e30 makes ~1e30 weights: finite in fp32, inf in the next forward), and at most what
    `dtype` holds (fp16: 65504), so the published cast stays finite too."""
    return min(torch.finfo(dtype).max, torch.finfo(torch.float32).max ** 0.5)


class Diverged(RuntimeError):
    """A step produced a non-finite loss, gradient norm or weight: the run stops there, before
    the version is published. The run's own failure: a trainer started again from its
    checkpoint would only repeat it."""


def check_finite_step(backend: TrainerBackend, stats: dict[str, float], version: int) -> None:
    """Diverged naming `version` (the one the step makes) when its loss or gradient norm, or a
    weight after it, is not finite (a version that cannot be served must never be committed)."""
    for key in ("loss", "grad_norm"):
        value = float(stats.get(key, 0.0))
        if not math.isfinite(value):
            raise Diverged(f"diverged: {key} is {value} at the step to v{version}")
    name = backend.nonfinite_weight()
    if name is not None:
        raise Diverged(f"diverged: non-finite weights at v{version} ({name})")


class TrainerBackend(ABC):
    """Owns the model and optimizer. Implementations: torch (HF) and megatron (megatron-core)."""

    device: torch.device
    """Where the model runs and packed batches go (set by each backend)."""

    def __init__(self, spec: ExperimentSpec):
        self.spec = spec
        self.pad_id = 0  # the model config's pad_token_id once loaded
        self.steps = 0  # optimizer versions trained so far: the version the next step trains
        self.loss_cfg = LossConfig.from_spec(spec)
        get_logger().info("trainer_objective", backend=spec.trainer.backend, **vars(self.loss_cfg))

    @abstractmethod
    def load(self, model_dir: str) -> None:
        """Build the model from a HuggingFace directory and create the optimizer."""

    @abstractmethod
    def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """Recompute proximal logprobs, run `trainer.minibatches` optimizer updates with the
        spec's objective (`services.trainer.losses`). Returns metrics: loss, clip_fraction,
        entropy, kl, grad_norm, tokens (loss tokens), lr, reward_mean, and the diagnostics of
        `losses.diagnostics` (behaviour weights, masked and truncated fractions, the logprob
        mismatch at the version trained from)."""

    @abstractmethod
    def save_hf(self, out_dir: Path) -> None:
        """Write config.json + model.safetensors (HuggingFace names) into out_dir."""

    def hf_files(self) -> dict[str, bytes]:
        """The current weights as the files `save_hf` writes (name -> bytes, config.json and
        model.safetensors at least): a snapshot that later steps do not change, for the trainer
        to write where it likes. Every rank calls it; only the writer rank's answer is used.
        By default `save_hf` into a temporary directory, read back."""
        with tempfile.TemporaryDirectory() as d:
            self.save_hf(Path(d))
            return {p.name: p.read_bytes() for p in Path(d).iterdir() if p.is_file()}

    def hf_state(self) -> tuple[Mapping[str, torch.Tensor], bytes]:
        """The weights as HF names -> tensors in the published dtype (the live parameters where
        they are already that: not a copy; a tied lm_head left out) and config.json's bytes,
        for `trainer.weight_sync: broadcast` to pack. Every rank calls it (the writer's
        answer is used)."""
        raise NotImplementedError(f"{type(self).__name__} cannot stream its weights")

    @abstractmethod
    def save_checkpoint(self, ckpt_dir: Path) -> None:
        """Model + optimizer state (+ RNG) so that load_checkpoint continues bit-for-bit."""

    @abstractmethod
    def load_checkpoint(self, ckpt_dir: Path) -> None: ...

    @abstractmethod
    def logprobs(self, groups: list[TrajectoryGroup]) -> list[list[list[float]]]:
        """Per group, per sample, the current model's logprobs of the output tokens."""

    def nonfinite_weight(self) -> str | None:
        """The name of a weight that is NaN or inf in a forward, if any (checked after each
        step): NaN, inf, or beyond `finite_bound` of its dtype. None by default: a backend
        without the check relies on its loss and gradient norm."""
        return None

    def close(self) -> None:
        """Release what the backend holds beyond this process (e.g. follower ranks under
        torchrun). Called once when the trainer shuts down; a no-op by default."""
        return None

    # -- shared by the implementations ------------------------------------------------------
    def _pack(self, groups: list[TrajectoryGroup]) -> PackedBatch:
        """The groups packed with `pad_id`, every tensor on `device`."""
        batch = pack_groups(groups, pad_id=self.pad_id, estimator=self.loss_cfg.advantage)
        return PackedBatch(
            **{
                k: (v.to(self.device) if isinstance(v, torch.Tensor) else v)
                for k, v in vars(batch).items()
            }
        )

    def _prepare(
        self, batch: PackedBatch, prox: torch.Tensor, ref: torch.Tensor | None
    ) -> tuple[PackedBatch, Correction, dict[str, float]]:
        """What a step fixes before its first update, from the whole batch's proximal (and
        reference) logprobs: the advantages (of KL-penalised rewards with `kl_in: reward`),
        the off-policy correction, and the step's metrics known so far (the diagnostics,
        tokens, reward_mean; kl for a reward penalty)."""
        cfg = self.loss_cfg
        metrics: dict[str, float] = {}
        if cfg.kl_in_reward:
            kl_seq = kl_reward_penalty(prox, ref, batch.loss_mask, cfg.kl_estimator)
            rewards = batch.rewards - cfg.kl_coef * kl_seq
            advantages = sample_advantages(
                rewards, batch.group_index, batch.reward_ok, cfg.advantage
            )
            batch = batch.with_sample_advantages(advantages)
            metrics["kl"] = kl_seq.sum().item() / max(batch.n_tokens, 1)
        corr = behaviour_correction(prox, batch.behav_logp, batch.loss_mask, cfg)
        sums = diagnostic_sums(
            corr, prox, batch.behav_logp, batch.loss_mask, batch.versions, self.steps
        )
        metrics |= diagnostics(*sums)
        metrics["tokens"] = float(batch.n_tokens)
        metrics["reward_mean"] = batch.rewards.mean().item()
        return batch, corr, metrics

    def _has_gradient(self, batch: PackedBatch, corr: Correction, rows: torch.Tensor) -> bool:
        """Whether minibatch `rows` has a token the loss reads: one the correction kept (its
        weight is not 0), or any loss token when a KL or entropy term is in the loss. A
        minibatch without one (every sample FAILED, or every token masked) has no gradient and
        is skipped: an Adam step on zero gradients would still move the weights (momentum)."""
        cfg = self.loss_cfg
        if cfg.kl_in_loss or cfg.entropy_coef > 0:
            return bool(batch.loss_mask[rows].sum() > 0)
        return bool((corr.weight[rows] != 0).any())

    def _rng_state(self) -> dict:
        """The RNG states a checkpoint saves: torch (CPU), python and numpy."""
        return {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }

    def _set_rng_state(self, state: dict) -> None:
        """Restore what `_rng_state` returned."""
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
