"""The spec's one definition: its wire form (JSON), its published JSON Schema, and the choice
lists derived from the registries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.errors import SpecError
from asyncrl.registry import ENGINES, FILTERS, TRAINER_BACKENDS
from asyncrl.spec import ExperimentSpec, json_schema, spec_from_json, spec_to_json, validate_spec

SCHEMA = Path(__file__).parents[2] / "protos/asyncrl/v1/experiment.schema.json"
MINIMAL = {"model": {"path": "m"}, "dataset": {"path": "d.jsonl"}}


def test_published_schema_is_the_one_generated_from_the_models():
    """`make schema` regenerates it; a spec change without it fails here."""
    committed = json.loads(SCHEMA.read_text())
    assert committed == json.loads(json.dumps(json_schema(), sort_keys=True))
    trainer = committed["$defs"]["TrainerSpec"]["properties"]
    assert trainer["batch_size"]["description"].startswith("B: groups per optimizer step")


def test_schema_choice_enums_come_from_the_registries():
    defs = json_schema()["$defs"]
    assert defs["RolloutSpec"]["properties"]["engine"]["enum"] == list(ENGINES.names)
    assert defs["RolloutSpec"]["properties"]["filter"]["enum"] == list(FILTERS.names)
    assert defs["TrainerSpec"]["properties"]["backend"]["enum"] == list(TRAINER_BACKENDS.names)


def test_spec_json_round_trip_keeps_every_field_and_integer_types():
    spec = validate_spec(
        MINIMAL | {"rollout": {"workflow": {"name": "multi_turn", "args": {"max_turns": 3}}}}
    )
    back = spec_from_json(spec_to_json(spec))
    assert (spec.trainer.weight_sync, back.trainer.weight_sync) == ("auto", "broadcast")
    spec.trainer.weight_sync = "broadcast"  # `auto` is chosen on the wire (the scheduler's submit)
    assert back == spec
    assert spec_from_json(spec_to_json(back)) == back
    assert back.rollout.workflow.args == {"max_turns": 3}
    assert type(back.rollout.workflow.args["max_turns"]) is int


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"rollout": {"engine": "vllm"}}, "rollout.engine"),
        ({"trainer": {"backend": "jax"}}, "trainer.backend"),
        ({"rollout": {"workflow": {"name": "nope"}}}, "rollout.workflow.name"),
        ({"reward": {"function": "plugin:not a module"}}, "reward.function"),
        ({"trainer": {"bogus": 1}}, "trainer.bogus"),
    ],
)
def test_bad_choice_spec_error_names_the_field(patch, field):
    with pytest.raises(SpecError) as e:
        validate_spec(MINIMAL | patch)
    assert e.value.field == field


def test_plugin_names_are_checked_by_syntax_only_never_imported():
    spec = validate_spec(
        MINIMAL
        | {
            "reward": {"function": "plugin:not_installed_pkg:score"},
            "rollout": {"workflow": {"name": "not_installed_pkg.flows:Agent"}},
        }
    )
    assert spec.reward.function == "plugin:not_installed_pkg:score"


def test_bad_json_is_a_spec_error():
    with pytest.raises(SpecError) as e:
        spec_from_json("{not json")
    assert e.value.field == "spec_json"  # the wire field that carries it
    assert isinstance(ExperimentSpec.model_validate(MINIMAL), ExperimentSpec)


def test_several_bad_fields_first_named_others_listed():
    with pytest.raises(SpecError) as e:
        validate_spec(MINIMAL | {"trainer": {"lr": -1, "batch_size": 0}})
    assert e.value.field == "trainer.batch_size"
    assert "also invalid: trainer.lr" in str(e.value)


def test_check_sizes_names_the_first_oversized_string_key_or_container():
    from asyncrl.spec import MAX_ITEMS, MAX_NAME, MAX_TEXT, check_sizes

    check_sizes({"a": ["x" * MAX_TEXT], "b": {"k" * MAX_NAME: list(range(MAX_ITEMS))}})  # at
    with pytest.raises(SpecError) as e:
        check_sizes({"a": {"b": ["ok", "x" * (MAX_TEXT + 1)]}})
    assert (e.value.field, e.value.reason) == (
        "a.b.1",
        f"{MAX_TEXT + 1} characters, at most {MAX_TEXT}",
    )
    with pytest.raises(SpecError) as e:
        check_sizes({"a": {"k" * (MAX_NAME + 1): 1}})
    assert (e.value.field, e.value.reason) == (
        "a",
        f"a key of {MAX_NAME + 1} characters, at most {MAX_NAME}",
    )
    with pytest.raises(SpecError) as e:
        check_sizes({"a": [0] * (MAX_ITEMS + 1)})
    assert (e.value.field, e.value.reason) == ("a", f"{MAX_ITEMS + 1} entries, at most {MAX_ITEMS}")


def test_largest_field_descends_while_a_part_holds_half_of_its_parent():
    from asyncrl.spec import largest_field

    # reward.kwargs holds nearly all; inside it no single value holds half: the kwargs
    spec = {"name": "n", "reward": {"function": "f", "kwargs": {"a": "x" * 100, "b": "y" * 100}}}
    assert largest_field(spec) == "reward.kwargs"
    spec["reward"]["kwargs"]["a"] = "x" * 1000  # now "a" is more than half of the kwargs
    assert largest_field(spec) == "reward.kwargs.a"
    assert largest_field({"a": "xy", "b": "zw"}) == "spec_json"  # no part holds half
