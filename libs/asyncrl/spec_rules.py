"""The spec's rules across sections, checked after each section validated on its own
(`asyncrl.spec.validate_spec`, `spec_from_json`): what a part cannot serve (LoRA on the megatron
backend, a broadcast into SGLang) and what `trainer.weight_sync: auto` turns into."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.errors import SpecError

if TYPE_CHECKING:
    from asyncrl.spec import ExperimentSpec


def check_lora(spec: ExperimentSpec) -> None:
    """SpecError("trainer.lora") where LoRA is asked of a part that cannot serve it: the
    megatron backend (its GPTModel has no adapter layers here, and a full-model export per
    version is what LoRA is meant to avoid) and the NCCL weight sync (it broadcasts the
    model's tensors into SGLang's; an adapter version reaches SGLang by `/load_lora_adapter`
    from disk or the NATS object store). docs/lora.md."""
    if spec.trainer.lora is None:
        return
    if spec.trainer.backend != "torch":
        raise SpecError(
            "trainer.lora",
            f"LoRA trains on the torch backend only, not {spec.trainer.backend!r}: the megatron "
            "backend has no adapter layers (set trainer.backend: torch, or drop trainer.lora)",
        )
    if spec.trainer.weight_sync in ("nccl", "broadcast"):
        raise SpecError(
            "trainer.lora",
            "LoRA versions reach the engines as adapter files, not a broadcast of the model's "
            f"tensors ({spec.trainer.weight_sync!r}): set trainer.weight_sync to disk or nats",
        )


def chosen_weight_sync(spec: ExperimentSpec, weights_transport: str = "file") -> str:
    """`trainer.weight_sync` as it runs: `auto` is `broadcast` where it is faster than the
    store (the torch engine, no LoRA), else `disk` (SGLang's `nccl` needs addresses only the
    user knows; a LoRA version is adapter files), or `nats` under the deprecated
    ASYNCRL_WEIGHTS_TRANSPORT=nats (`weights_transport`: the deployment shares no disk)."""
    if spec.trainer.weight_sync != "auto":
        return spec.trainer.weight_sync
    if weights_transport == "nats":
        return "nats"
    torch_engine = spec.rollout.engine == "torch" and spec.trainer.lora is None
    return "broadcast" if torch_engine else "disk"


def check_broadcast(spec: ExperimentSpec) -> None:
    """`broadcast` streams into the torch engine; SGLang takes collective updates by `nccl`."""
    if spec.trainer.weight_sync == "broadcast" and spec.rollout.engine != "torch":
        raise SpecError(
            "trainer.weight_sync",
            f"broadcast streams into the torch engine, not {spec.rollout.engine!r}: set "
            "trainer.weight_sync to nccl for SGLang (or disk, nats)",
        )
