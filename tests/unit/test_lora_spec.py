"""`trainer.lora` in the spec: its defaults and bounds, and the parts that refuse it with a
SpecError naming `trainer.lora` (megatron backend, NCCL weight sync) on every path a spec takes in
(`validate_spec` for files and the CLI, `spec_from_json` for the wire)."""

from __future__ import annotations

import json

import pytest

from asyncrl.errors import SpecError
from asyncrl.spec import LoraSpec, json_schema, spec_from_json, spec_to_json, validate_spec

TORCH = {
    "model": {"path": "m"},
    "dataset": {"path": "d.jsonl"},
    "trainer": {"backend": "torch", "lora": {}},
}


def with_(base: dict, **sections) -> dict:
    return {**base, **{k: {**base.get(k, {}), **v} for k, v in sections.items()}}


def test_lora_defaults_and_wire_round_trip():
    spec = validate_spec(TORCH)
    assert spec.trainer.lora == LoraSpec(
        rank=8, alpha=16.0, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    back = spec_from_json(spec_to_json(spec))
    assert back.trainer.weight_sync == "disk"  # `auto`: an adapter travels as files
    assert back.model_dump() == {**spec.model_dump(), "trainer": back.trainer.model_dump()}
    assert back.trainer.model_copy(update={"weight_sync": "auto"}) == spec.trainer
    assert validate_spec({k: v for k, v in TORCH.items() if k != "trainer"}).trainer.lora is None
    props = json_schema()["$defs"]["LoraSpec"]["properties"]
    assert sorted(props) == ["alpha", "dropout", "rank", "target_modules"]


@pytest.mark.parametrize(
    ("lora", "field"),
    [
        ({"rank": 0}, "trainer.lora.rank"),
        ({"alpha": 0}, "trainer.lora.alpha"),
        ({"dropout": 1.0}, "trainer.lora.dropout"),
        ({"target_modules": []}, "trainer.lora.target_modules"),
        ({"target_modules": ["q_proj", "q_proj"]}, "trainer.lora.target_modules"),
        ({"target_modules": ["layers.*"]}, "trainer.lora.target_modules"),
        ({"ranks": 4}, "trainer.lora.ranks"),
    ],
)
def test_bad_lora_field_is_named(lora, field):
    with pytest.raises(SpecError) as e:
        validate_spec(with_(TORCH, trainer={"lora": lora}))
    assert e.value.field == field


@pytest.mark.parametrize(
    ("sections", "named"),
    [
        ({"trainer": {"backend": "megatron"}}, "'megatron'"),
        (
            {"trainer": {"weight_sync": "nccl", "nccl_master": "h:1", "nccl_world_size": 2}},
            "'nccl'",
        ),
    ],
)
def test_lora_refused_where_it_cannot_run_on_every_way_in(sections, named):
    data = with_(TORCH, **sections)
    for parse in (validate_spec, lambda d: spec_from_json(json.dumps(d))):
        with pytest.raises(SpecError) as e:
            parse(data)
        assert e.value.field == "trainer.lora" and named in e.value.reason
    data["trainer"]["lora"] = None  # the same spec without LoRA is fine
    validate_spec(data)
