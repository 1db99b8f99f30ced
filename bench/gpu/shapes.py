"""The model shapes the check runs, and random-weight HuggingFace directories of them.

Nothing is downloaded: each directory holds a randomly initialised model of the named shape
(config.json + model.safetensors, fp32) and the character tokenizer of `asyncrl.tiny` (with a
chat template), so the vocabulary rows beyond the tokenizer's ~100 characters decode to nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch

SHAPES: dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct's config.json (the model docs/megatron.md checks)
    "smollm2-135m": dict(
        family="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # Qwen/Qwen2.5-0.5B's config.json (494M parameters)
    "qwen2-0.5b": dict(
        family="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # --dry-run stand-ins: the same families, small enough for a CPU in seconds
    "tiny-llama": dict(
        family="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "tiny-qwen2": dict(
        family="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


def n_params(name: str) -> int:
    """Parameters of a shape (tied embeddings counted once), from the defining formula of a
    Llama/Qwen2 decoder: embeddings V*H; per layer q (H*H), k and v (2*H*kv*d), o (H*H), the
    SwiGLU MLP (3*H*I) and two RMSNorms (2*H), Qwen2's q/k/v biases (H + 2*kv*d); a final norm."""
    s = SHAPES[name]
    h, i, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    d = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * d
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    if s["family"] == "qwen2":
        layer += h + 2 * kv
    return v * h + s["num_hidden_layers"] * layer + h


def build(name: str, out_dir: Path, seed: int = 0) -> Path:
    """A random-weight model of shape `name` in `out_dir` (reused if already there)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from asyncrl.tiny import CHAT_TEMPLATE, build_char_tokenizer

    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer(out_dir)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out_dir))
    shape = dict(SHAPES[name])
    family = shape.pop("family")
    config_cls = LlamaConfig if family == "llama" else Qwen2Config
    cfg = config_cls(
        **shape,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir
