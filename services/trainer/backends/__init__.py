"""Trainer backends behind one contract (`base.TrainerBackend`), imported lazily: the megatron
backend pulls in megatron-core, which a torch-only trainer never needs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.spec import ExperimentSpec, SpecError

if TYPE_CHECKING:
    from services.trainer.backends.base import TrainerBackend

BACKENDS = ("torch", "megatron")


def make_backend(spec: ExperimentSpec) -> TrainerBackend:
    """The backend named by `spec.trainer.backend`, not yet loaded."""
    name = spec.trainer.backend
    if name == "torch":
        from services.trainer.backends.torch_backend import TorchBackend

        return TorchBackend(spec)
    if name == "megatron":
        from services.trainer.backends.megatron_backend import MegatronBackend

        return MegatronBackend(spec)
    raise SpecError("trainer.backend", f"unknown backend {name!r} (one of {', '.join(BACKENDS)})")
