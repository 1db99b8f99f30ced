"""LoRA adapters for tests: a peft adapter with a random B on a tiny base (peft starts B at
zero, which changes nothing), published as the trainer publishes a version, and the greedy
tokens peft's own adapted model gives (the reference an engine must match)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from asyncrl import fingerprint
from asyncrl.spec import LoraSpec, SamplingParams
from services.rollout.engine import GenRequest
from services.trainer import lora
from services.trainer.publish import write_version

EXP = "exp-lora"
LORA = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def peft_model(base, seed: int, std: float = 0.5, spec: LoraSpec = LORA):
    """The base with a LoRA adapter whose A and B are random (seeded)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model = lora.wrap(model, spec)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def publish(root, base, version: int, model) -> tuple[str, str]:
    """The adapter as the trainer publishes a version: (directory, manifest fingerprint)."""
    uri = write_version(root, EXP, version, lora.adapter_files(model), base, keep=8)
    d = root / EXP / f"v{version:06d}"
    assert uri == d.as_uri()
    return str(d), fingerprint.read_manifest(d)


def greedy(rid: str, prompt: list[int], n: int = 8) -> GenRequest:
    return GenRequest(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=n))


@torch.no_grad()
def peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
