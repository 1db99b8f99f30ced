"""Trainer backends behind one contract (`base.TrainerBackend`), named in
`asyncrl.registry.TRAINER_BACKENDS` and imported only when chosen: the megatron backend pulls
in megatron-core, which a torch-only trainer never needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.registry import TRAINER_BACKENDS
from asyncrl.spec import ExperimentSpec

if TYPE_CHECKING:
    from services.trainer.backends.base import TrainerBackend


def make_backend(spec: ExperimentSpec) -> TrainerBackend:
    """The backend named by `spec.trainer.backend`, not yet loaded."""
    return TRAINER_BACKENDS.load(spec.trainer.backend)(spec)
