"""A megatron-core GPTModel from a HuggingFace Qwen2/Llama config, and its forward pass.

`build_model` maps config.json onto a `TransformerConfig` (GQA, RoPE with the model's base,
RMSNorm, SwiGLU, Qwen2's qkv bias, tied or untied embeddings) and builds a `GPTModel` with the
local layer spec (no Transformer Engine / Apex needed). `token_logprobs` and `token_entropy`
are the vocab-parallel versions of `services.trainer.algo`'s: logits stay sharded over the TP ranks and
the padded vocabulary rows are masked out, so the numbers equal the HuggingFace model's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from asyncrl.errors import SpecError
from services.trainer.megatron.convert import Layout, layout_from_hf_config

SUPPORTED = ("qwen2", "llama")
PAD_LOGIT = -1e9
"""Logit given to padded vocabulary rows: exp() of it is exactly 0 in fp32."""


@dataclass
class BuiltModel:
    model: torch.nn.Module
    """The GPTModel (unwrapped)."""
    layout: Layout
    hf_config: dict
    tp_rank: int
    tp_size: int


def read_hf_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _rope(cfg: dict) -> tuple[float, bool, float]:
    """(base, llama3 scaling on?, scaling factor) from either config style
    (transformers >= 5 `rope_parameters`, older `rope_theta` + `rope_scaling`)."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    base = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return base, False, 1.0
    llama3_fixed = {
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if kind == "llama3" and all(float(params.get(k, v)) == v for k, v in llama3_fixed.items()):
        return base, True, float(params["factor"])
    raise SpecError("model.path", f"rope scaling {params} is not supported by the megatron backend")


def check_supported(cfg: dict, tp_size: int) -> None:
    """Raise SpecError for configs the conversion cannot represent exactly."""
    kind = cfg.get("model_type")
    if kind not in SUPPORTED:
        raise SpecError("model.path", f"model_type {kind!r} not supported (one of {SUPPORTED})")
    if cfg.get("mlp_bias") or (kind == "llama" and cfg.get("attention_bias")):
        raise SpecError("model.path", "o_proj / MLP biases are not supported")
    if cfg.get("use_sliding_window"):
        raise SpecError("model.path", "sliding-window attention is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise SpecError("model.path", f"hidden_act {cfg.get('hidden_act')!r} is not silu")
    lay = layout_from_hf_config(cfg, tp_size)
    for what, n in (
        ("num_key_value_heads", lay.num_kv_heads),
        ("intermediate_size", lay.ffn_hidden_size),
    ):
        if n % tp_size:
            raise SpecError("trainer.tp_size", f"{tp_size} does not divide {what}={n}")
    _rope(cfg)


def transformer_config(cfg: dict, *, cuda: bool):
    from megatron.core.transformer import TransformerConfig

    lay = layout_from_hf_config(cfg)
    dtype = torch.bfloat16 if cuda else torch.float32
    return TransformerConfig(
        num_layers=lay.num_layers,
        hidden_size=lay.hidden_size,
        ffn_hidden_size=lay.ffn_hidden_size,
        num_attention_heads=lay.num_heads,
        num_query_groups=lay.num_kv_heads,
        kv_channels=lay.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=lay.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # the weights are overwritten from the checkpoint, but initialisation is also what
        # marks parameters as TP-sharded (`tensor_model_parallel`): keep it on
        perform_initialization=True,
        use_cpu_initialization=not cuda,
        params_dtype=dtype,
        bf16=cuda,
        # plain-torch kernels (no TE / Apex): no fusions
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # the loss is normalised by the global token count: DDP sums gradients, no averaging
        calculate_per_token_loss=True,
    )


def build_model(cfg: dict, tp_rank: int, tp_size: int, *, cuda: bool) -> BuiltModel:
    """A GPTModel for this TP rank (parallel_state must be initialised)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    check_supported(cfg, tp_size)
    lay = layout_from_hf_config(cfg, tp_size)
    base, scaling, factor = _rope(cfg)
    model = GPTModel(
        config=transformer_config(cfg, cuda=cuda),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=lay.padded_vocab_size,
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=base,
        rope_scaling=scaling,
        rope_scaling_factor=factor,
        share_embeddings_and_output_weights=lay.tied,
        parallel_output=True,
    )
    if cuda:
        model.cuda(torch.cuda.current_device())
    return BuiltModel(model=model, layout=lay, hf_config=cfg, tp_rank=tp_rank, tp_size=tp_size)


def attention_mask(padding: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean mask [b, 1, s, s] (True = masked): causal and padded keys."""
    s = padding.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=padding.device), diagonal=1)
    pad_keys = (padding == 0)[:, None, None, :]
    return causal[None, None] | pad_keys


def forward_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, padding: torch.Tensor
) -> torch.Tensor:
    """Vocab-sharded fp32 logits in target space: [b, s-1, V_padded / tp]."""
    b, s = input_ids.shape
    pos = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    logits = model(input_ids, pos, attention_mask(padding))
    return logits[:, :-1].float()


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """A new tensor with the logits of padded vocabulary rows set to PAD_LOGIT."""
    local = logits.shape[-1]
    ids = torch.arange(tp_rank * local, (tp_rank + 1) * local, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, PAD_LOGIT)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, tp_rank: int
) -> torch.Tensor:
    """Per-token log p(target) from vocab-sharded logits (differentiable, TP-aware)."""
    from megatron.core import tensor_parallel

    masked = mask_padded_vocab(logits, vocab_size, tp_rank)  # a fresh tensor: safe to modify
    return -tensor_parallel.vocab_parallel_cross_entropy(masked, targets)


def token_entropy(logits: torch.Tensor, vocab_size: int, tp_rank: int, group) -> torch.Tensor:
    """Per-token entropy of the full softmax from vocab-sharded logits: log S - sum(e x) / S
    over the shards (x = logits - max, e = exp x, S = sum e). Differentiable: the shard sums
    are added with megatron's all-reduce whose backward passes each shard its own gradient
    (the max is a constant shift; its value does not change the entropy)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    x = mask_padded_vocab(logits, vocab_size, tp_rank)
    m = x.detach().max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = x - m.unsqueeze(-1)
    e = shifted.exp()
    total = reduce_from_tensor_model_parallel_region(e.sum(-1))
    weighted = reduce_from_tensor_model_parallel_region((e * shifted).sum(-1))
    return total.log() - weighted / total


# -- weights in and out ------------------------------------------------------------------------


def params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(model.named_parameters())


@torch.no_grad()
def load_hf_weights(built: BuiltModel, hf: dict[str, torch.Tensor]) -> None:
    """Copy a HuggingFace state dict into this rank's shard of the model."""
    from services.trainer.megatron.convert import hf_to_megatron, shard_tensor

    full = hf_to_megatron(hf, built.layout)
    own = params(built.model)
    if set(own) != set(full):
        raise ValueError(
            f"weight names differ: model-only {sorted(set(own) - set(full))}, "
            f"checkpoint-only {sorted(set(full) - set(own))}"
        )
    for name, p in own.items():
        p.copy_(shard_tensor(name, full[name], built.tp_size, built.tp_rank))


@torch.no_grad()
def gather_hf_weights(built: BuiltModel, group) -> dict[str, torch.Tensor]:
    """The full model in HuggingFace names (fp32 on CPU), gathered over the TP group on every rank."""
    from services.trainer.megatron.convert import megatron_to_hf, unshard_tensor

    full = {}
    for name, p in params(built.model).items():
        local = p.detach().float().contiguous()
        if built.tp_size > 1:
            parts = [torch.empty_like(local) for _ in range(built.tp_size)]
            dist.all_gather(parts, local, group=group)
        else:
            parts = [local.clone()]  # a copy: callers may keep it while training goes on
        full[name] = unshard_tensor(name, [t.cpu() for t in parts])
    return megatron_to_hf(full, built.layout)
