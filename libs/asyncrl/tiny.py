"""Tiny HuggingFace-format models and a character-level tokenizer, built locally.

Used by the tests and the demo: real `transformers` models (Qwen2 or Llama architecture) small
enough to train on a CPU in seconds, saved exactly like a hub checkpoint (config.json,
model.safetensors, tokenizer.json), so every code path that loads a real model loads these.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list(string.digits + string.ascii_letters + string.punctuation + " ")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
"""A ChatML-like template the character tokenizer can spell ("u:1+1=<eos>a:"): a turn ends
with the EOS token, as in real chat models. Not set by default; tests and benchmarks of chat
workflows assign it."""


def build_char_tokenizer(out_dir: str | Path):
    """A character-level tokenizer (one token per printable ASCII char) saved to out_dir."""
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(
    out_dir: str | Path,
    family: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    max_position_embeddings: int = 256,
):
    """Build a randomly initialised tiny causal LM + char tokenizer and save both to out_dir."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer(out_dir)
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    if family == "qwen2":
        cfg = Qwen2Config(**common)
    elif family == "llama":
        cfg = LlamaConfig(**common)
    else:
        raise ValueError(f"unknown family {family!r} (qwen2 | llama)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model, tok
