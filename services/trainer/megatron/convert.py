"""HuggingFace <-> megatron-core weight conversion for Qwen2 / Llama decoders. Pure tensors.

Three layers, each a plain function over ``dict[str, Tensor]``:

1. ``hf_to_megatron`` / ``megatron_to_hf``: names and shapes between a HuggingFace state dict
   and a *full* (unsharded) megatron-core ``GPTModel`` state dict built with the local layer
   spec (``get_gpt_layer_local_spec``). q/k/v merge into ``linear_qkv`` per KV group, gate/up
   concatenate into ``linear_fc1``, the embedding (and untied output layer) is padded with zero
   rows to the padded vocabulary.
2. ``shard`` / ``unshard``: a full megatron state dict <-> the slice one tensor-parallel rank
   holds (column-parallel on dim 0, row-parallel on dim 1, fc1's gate and up halves apart).
3. ``padded_vocab_size``: the padded vocabulary Megatron uses (a multiple of 128 * tp).

Megatron's ``linear_qkv`` rows are ordered per KV group g as [q heads of g, k of g, v of g], so
a contiguous dim-0 split gives each TP rank whole groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

VOCAB_DIVISOR = 128
"""Megatron pads the vocabulary to a multiple of this times the TP size."""


@dataclass(frozen=True)
class Layout:
    """The shapes that decide the conversion, read from a HuggingFace config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    """The real vocabulary (HuggingFace `vocab_size`)."""
    padded_vocab_size: int
    """Rows of Megatron's embedding / output layer (>= vocab_size)."""
    tied: bool
    """Embedding and output layer share one weight (no `lm_head.weight` / `output_layer.weight`)."""
    qkv_bias: bool
    """q/k/v projections carry a bias (Qwen2)."""

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def padded_vocab_size(vocab_size: int, tp_size: int, divisor: int = VOCAB_DIVISOR) -> int:
    multiple = divisor * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def layout_from_hf_config(cfg: dict, tp_size: int = 1) -> Layout:
    """Layout of a Qwen2/Llama `config.json` dict (padded for `tp_size`)."""
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    return Layout(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        padded_vocab_size=padded_vocab_size(cfg["vocab_size"], tp_size),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
    )


# -- 1. names and shapes ---------------------------------------------------------------------


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _mg_layer(i: int) -> str:
    return f"decoder.layers.{i}."


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Layout) -> torch.Tensor:
    """HF q [heads*d, ...], k/v [kv*d, ...] -> Megatron [(q_per_g + 2) * d * kv, ...]."""
    g, d = lay.num_kv_heads, lay.head_dim
    rest = q.shape[1:]
    parts = (
        q.reshape(g, lay.q_per_group * d, *rest),
        k.reshape(g, d, *rest),
        v.reshape(g, d, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, lay: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `merge_qkv`."""
    g, d = lay.num_kv_heads, lay.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (lay.q_per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [lay.q_per_group * d, d, d], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])], dim=0)


def hf_to_megatron(hf: dict[str, torch.Tensor], lay: Layout) -> dict[str, torch.Tensor]:
    """A HuggingFace state dict -> a full megatron-core GPTModel state dict (no _extra_state)."""
    vocab = lay.padded_vocab_size
    out = {"embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], vocab)}
    for i in range(lay.num_layers):
        h, m = _hf_layer(i), _mg_layer(i)
        attn = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = merge_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], lay
        )
        if lay.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = merge_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], lay
            )
        out[m + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], dim=0
        )
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not lay.tied:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], vocab)
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], lay: Layout) -> dict[str, torch.Tensor]:
    """A full megatron-core state dict -> HuggingFace names and shapes (vocab padding cut)."""
    out = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][: lay.vocab_size]}
    for i in range(lay.num_layers):
        h, m = _hf_layer(i), _mg_layer(i)
        attn = h + "self_attn."
        out[h + "input_layernorm.weight"] = mg[m + "input_layernorm.weight"]
        for kind in ("weight", "bias") if lay.qkv_bias else ("weight",):
            qkv = split_qkv(mg[f"{m}self_attention.linear_qkv.{kind}"], lay)
            for proj, tensor in zip(("q_proj", "k_proj", "v_proj"), qkv, strict=True):
                out[f"{attn}{proj}.{kind}"] = tensor
        out[attn + "o_proj.weight"] = mg[m + "self_attention.linear_proj.weight"]
        out[h + "post_attention_layernorm.weight"] = mg[m + "pre_mlp_layernorm.weight"]
        gate, up = torch.chunk(mg[m + "mlp.linear_fc1.weight"], 2, dim=0)
        out[h + "mlp.gate_proj.weight"] = gate.contiguous()
        out[h + "mlp.up_proj.weight"] = up.contiguous()
        out[h + "mlp.down_proj.weight"] = mg[m + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    if not lay.tied:
        out["lm_head.weight"] = mg["output_layer.weight"][: lay.vocab_size]
    return {k: v.contiguous() for k, v in out.items()}


# -- 2. tensor-parallel sharding ---------------------------------------------------------------

ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
"""Split on dim 1 (input features)."""
COLUMN_PARALLEL = (
    "embedding.word_embeddings.weight",
    "output_layer.weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
)
"""Split on dim 0 (output features / vocabulary rows)."""
GATED = ("mlp.linear_fc1.weight",)
"""Column-parallel, but gate and up halves are split separately and re-joined per rank."""


def shard_spec(name: str) -> str:
    """How a parameter is split across TP ranks: 'row', 'column', 'gated' or 'replicated'."""
    if name.endswith(ROW_PARALLEL):
        return "row"
    if name.endswith(GATED):
        return "gated"
    if name.endswith(COLUMN_PARALLEL):
        return "column"
    return "replicated"


def shard_tensor(name: str, full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    kind = shard_spec(name)
    if kind == "row":
        return full.chunk(tp_size, dim=1)[tp_rank].contiguous()
    if kind == "column":
        return full.chunk(tp_size, dim=0)[tp_rank].contiguous()
    if kind == "gated":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]], dim=0)
    return full


def unshard_tensor(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    kind = shard_spec(name)
    if kind == "row":
        return torch.cat(parts, dim=1)
    if kind == "column":
        return torch.cat(parts, dim=0)
    if kind == "gated":
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return parts[0]


def shard(mg: dict[str, torch.Tensor], tp_size: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """The slice of a full megatron state dict that TP rank `tp_rank` of `tp_size` holds."""
    return {k: shard_tensor(k, v, tp_size, tp_rank) for k, v in mg.items()}


def unshard(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Join the per-rank state dicts (in TP rank order) into the full one."""
    return {k: unshard_tensor(k, [p[k] for p in parts]) for k in parts[0]}
