"""The trainer-backend contract: one optimizer version per `train_step`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from asyncrl.spec import ExperimentSpec
from asyncrl.types import TrajectoryGroup


class TrainerBackend(ABC):
    """Owns the model and optimizer. Implementations: torch (HF) and megatron (megatron-core)."""

    def __init__(self, spec: ExperimentSpec):
        self.spec = spec

    @abstractmethod
    def load(self, model_dir: str) -> None:
        """Build the model from a HuggingFace directory and create the optimizer."""

    @abstractmethod
    def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """Recompute proximal logprobs, run `trainer.minibatches` optimizer updates with the
        decoupled PPO loss on GRPO advantages. Returns metrics: loss, clip_fraction, entropy,
        kl, grad_norm, tokens (loss tokens)."""

    @abstractmethod
    def save_hf(self, out_dir: Path) -> None:
        """Write config.json + model.safetensors (HuggingFace names) into out_dir."""

    @abstractmethod
    def save_checkpoint(self, ckpt_dir: Path) -> None:
        """Model + optimizer state (+ RNG) so that load_checkpoint continues bit-for-bit."""

    @abstractmethod
    def load_checkpoint(self, ckpt_dir: Path) -> None: ...

    @abstractmethod
    def logprobs(self, groups: list[TrajectoryGroup]) -> list[list[list[float]]]:
        """Per group, per sample, the current model's logprobs of the output tokens."""

    def close(self) -> None:
        """Release what the backend holds beyond this process (e.g. follower ranks under
        torchrun). Called once when the trainer shuts down; a no-op by default."""
        return None
