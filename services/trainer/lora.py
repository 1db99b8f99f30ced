"""LoRA on the torch backend (`trainer.lora`): the base model frozen, a peft adapter trained.

A version is the adapter, not the model: `adapter_files` is what `TrainerBackend.hf_files`
returns for it, `adapter_model.safetensors` (peft's names, `base_model.model.<module>.lora_A.
weight` [r, in] and `.lora_B.weight` [out, r]) and `adapter_config.json` (peft's
`LoraConfig`), so the weight store, the NATS object store, the fingerprint (every
*.safetensors of a version, `asyncrl.fingerprint`) and a rollout's UpdateWeights carry the
adapter alone. A checkpoint holds the adapter and the optimizer over its parameters
(`model_state`); the base is the spec's `model.path`, read again on resume.

The rollout's side, the same tensors applied per request in a batched forward, is
services/rollout/adapters.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import torch

from asyncrl.errors import SpecError
from asyncrl.spec import LoraSpec

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def wrap(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """`model` with a fresh LoRA adapter (peft's init: A random, B zero, so version 0 is the
    base) on the `spec.target_modules` linears; only the adapter's parameters train.
    SpecError("trainer.lora.target_modules") when none of the names is in the model."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise SpecError("trainer.lora.target_modules", str(e)) from None


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps and the gradient clip covers: the adapter under LoRA, every
    weight otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint saves of the model: the adapter's tensors under LoRA (peft's names),
    the whole state dict otherwise."""
    if not is_lora(model):
        return model.state_dict()
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Restore what `model_state` returned. Under LoRA every adapter tensor must be there
    (peft's loader would leave a missing one at its initial value without a word)."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    from peft import set_peft_model_state_dict

    expected = set(model_state(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"adapter checkpoint does not match: missing {missing[:3]}, extra {extra[:3]}"
        )
    set_peft_model_state_dict(model, state)


def adapter_files(model: torch.nn.Module) -> dict[str, bytes]:
    """The version's files: the adapter's tensors (fp32, contiguous, on the CPU) as
    safetensors, and its LoraConfig as JSON (what peft's save_pretrained writes)."""
    from safetensors.torch import save

    tensors = {k: v.to("cpu").contiguous() for k, v in model_state(model).items()}
    return {
        ADAPTER_WEIGHTS: save(tensors, metadata={"format": "pt"}),
        ADAPTER_CONFIG: adapter_config_json(model).encode(),
    }


def adapter_config_json(model: torch.nn.Module) -> str:
    """peft's LoraConfig of the adapter as JSON: sets as sorted lists, enums as their values."""
    config = model.peft_config["default"].to_dict()

    def plain(value):
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        return getattr(value, "value", str(value))

    return json.dumps(config, default=plain, sort_keys=True, indent=2)


@contextlib.contextmanager
def dropout_on(model: torch.nn.Module) -> Iterator[None]:
    """The adapter's dropout active for the forward inside (the backend keeps the model in
    eval mode otherwise: proximal logprobs and the base's own dropout stay off); a no-op for
    a model without an adapter."""
    drops = [m for name, m in model.named_modules() if name.endswith("lora_dropout.default")]
    for m in drops:
        m.train()
    try:
        yield
    finally:
        for m in drops:
            m.eval()


def reference(model: torch.nn.Module):
    """The context in which `model` computes the KL reference's logprobs: the base, adapter
    disabled, under LoRA (no copy of the model is kept); a no-op otherwise."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()
