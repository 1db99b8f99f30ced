"""HF <-> Megatron weight conversion: exact values on hand-made tensors, exact round trips on
the tiny Qwen2 / Llama checkpoints, TP sharding, vocab padding and config mapping."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.tiny import build_tiny_model
from services.trainer.megatron.convert import (
    Layout,
    hf_to_megatron,
    layout_from_hf_config,
    megatron_to_hf,
    merge_qkv,
    padded_vocab_size,
    shard,
    shard_tensor,
    split_qkv,
    unshard,
)
from services.trainer.megatron.model import _rope, check_supported, read_hf_config


def _layout(**kw) -> Layout:
    base = dict(
        num_layers=1,
        hidden_size=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=1,
        ffn_hidden_size=2,
        vocab_size=3,
        padded_vocab_size=4,
        tied=False,
        qkv_bias=True,
    )
    return Layout(**{**base, **kw})


def test_merge_qkv_two_kv_groups_interleaves_per_group():
    lay = _layout()
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # heads 0,1 -> group 0; heads 2,3 -> group 1
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    merged = merge_qkv(q, k, v, lay)
    assert merged.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    q2, k2, v2 = split_qkv(merged, lay)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_merge_qkv_bias_1d_same_layout_as_weight():
    lay = _layout(head_dim=2)
    q, k, v = torch.arange(8.0), torch.arange(100.0, 104.0), torch.arange(200.0, 204.0)
    merged = merge_qkv(q, k, v, lay)
    assert merged.tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


@pytest.mark.parametrize(
    ("vocab", "tp", "want"), [(99, 1, 128), (99, 2, 256), (128, 1, 128), (129, 1, 256)]
)
def test_padded_vocab_size_rounds_up_to_128_times_tp(vocab, tp, want):
    assert padded_vocab_size(vocab, tp) == want


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    build_tiny_model(root / "qwen2", family="qwen2", tie_word_embeddings=True)
    build_tiny_model(root / "llama", family="llama", tie_word_embeddings=False)
    return root


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_hf_to_megatron_to_hf_tiny_model_exact(tiny, family):
    cfg = read_hf_config(tiny / family)
    hf = load_file(str(tiny / family / "model.safetensors"))
    lay = layout_from_hf_config(cfg, tp_size=2)
    mg = hf_to_megatron(hf, lay)

    assert mg["embedding.word_embeddings.weight"].shape == (256, 64)
    assert torch.count_nonzero(mg["embedding.word_embeddings.weight"][99:]) == 0
    assert mg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert mg["decoder.layers.0.mlp.linear_fc1.weight"].shape == (256, 64)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mg) == (family == "qwen2")
    assert ("output_layer.weight" in mg) == (family == "llama")

    back = megatron_to_hf(mg, lay)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_shard_then_unshard_tp2_exact(tiny, family):
    cfg = read_hf_config(tiny / family)
    mg = hf_to_megatron(
        load_file(str(tiny / family / "model.safetensors")), layout_from_hf_config(cfg, 2)
    )
    parts = [shard(mg, 2, r) for r in range(2)]
    assert parts[1]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 32)
    assert parts[1]["embedding.word_embeddings.weight"].shape == (128, 64)
    assert torch.equal(
        parts[0]["decoder.final_layernorm.weight"], mg["decoder.final_layernorm.weight"]
    )
    full = unshard(parts)
    assert all(torch.equal(full[k], mg[k]) for k in mg)


def test_shard_fc1_each_rank_gets_its_gate_and_up_rows():
    fc1 = torch.arange(8.0).unsqueeze(1)  # gate rows 0..3, up rows 4..7
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert shard_tensor(name, fc1, 2, 0).flatten().tolist() == [0, 1, 4, 5]
    assert shard_tensor(name, fc1, 2, 1).flatten().tolist() == [2, 3, 6, 7]


def test_layout_from_hf_config_reads_gqa_and_bias(tiny):
    lay = layout_from_hf_config(read_hf_config(tiny / "qwen2"))
    assert (lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.q_per_group) == (4, 2, 16, 2)
    assert lay.qkv_bias and lay.tied and lay.padded_vocab_size == 128
    llama = layout_from_hf_config(read_hf_config(tiny / "llama"))
    assert not llama.qkv_bias and not llama.tied


def test_rope_both_config_styles_read_base():
    assert _rope({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}) == (
        1e6,
        False,
        1.0,
    )
    assert _rope({"rope_theta": 5e5}) == (5e5, False, 1.0)
    llama3 = {
        "rope_theta": 5e5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    assert _rope(llama3) == (5e5, True, 8.0)


def test_rope_yarn_scaling_raises():
    with pytest.raises(ValueError, match="rope scaling"):
        _rope({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_check_supported_unknown_family_raises(tiny):
    cfg = read_hf_config(tiny / "qwen2")
    with pytest.raises(ValueError, match="model_type"):
        check_supported({**cfg, "model_type": "gpt2"}, tp_size=1)


def test_check_supported_tp_not_dividing_kv_heads_raises(tiny):
    with pytest.raises(ValueError, match="trainer.tp_size"):
        check_supported(read_hf_config(tiny / "qwen2"), tp_size=4)
