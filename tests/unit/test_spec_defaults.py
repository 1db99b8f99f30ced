"""A spec a user can read: every field of the published JSON Schema has a description, and
`asyncrl spec --defaults` prints every default with it, as YAML that parses back to them."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from asyncrl.cli import app
from asyncrl.spec import ExperimentSpec, validate_spec
from asyncrl.spec_defaults import PLACEHOLDERS, default_spec

SCHEMA = Path(__file__).parents[2] / "protos/asyncrl/v1/experiment.schema.json"
runner = CliRunner()


def undescribed(schema: dict) -> list[str]:
    """`Section.field` for every property of the schema (top level and every $def) that has
    no description."""
    sections = {"ExperimentSpec": schema, **schema["$defs"]}
    return [
        f"{section}.{name}"
        for section, body in sections.items()
        for name, prop in body.get("properties", {}).items()
        if not prop.get("description", "").strip()
    ]


def test_schema_every_field_has_a_description():
    schema = json.loads(SCHEMA.read_text())
    assert len(schema["$defs"]) >= 8  # every section is there to be checked
    assert undescribed(schema) == []


def test_undescribed_field_is_named():
    schema = {"properties": {"a": {"description": "x"}}, "$defs": {"S": {"properties": {"b": {}}}}}
    assert undescribed(schema) == ["S.b"]


def test_spec_defaults_parses_back_to_every_default():
    got = runner.invoke(app, ["spec", "--defaults"])
    assert got.exit_code == 0, got.output
    parsed = yaml.safe_load(got.output)
    assert parsed == default_spec().model_dump(mode="json")
    assert validate_spec(parsed) == ExperimentSpec.model_validate(PLACEHOLDERS)


def test_spec_defaults_comments_every_field_with_its_description():
    text = runner.invoke(app, ["spec", "--defaults"]).output
    lines = text.splitlines()
    fields = [
        i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")
    ]
    assert len(fields) > 80
    uncommented = [lines[i] for i in fields if not lines[i - 1].lstrip().startswith("#")]
    assert uncommented == []
    assert "  # AdamW learning rate (the peak, with `lr_schedule: linear`)." in lines
    assert "  # (required) HuggingFace-format causal LM directory" in text


def test_spec_without_a_choice_exits_2():
    got = runner.invoke(app, ["spec"])
    assert got.exit_code == 2


def test_spec_schema_is_the_published_schema():
    got = runner.invoke(app, ["spec", "--schema"])
    assert got.exit_code == 0
    assert json.loads(got.output) == json.loads(SCHEMA.read_text())
