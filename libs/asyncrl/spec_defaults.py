"""The default spec as commented YAML (`asyncrl spec --defaults`): every field of
`asyncrl.spec.ExperimentSpec` with its default and its description as a comment above it.

The two fields without a default (`model.path`, `dataset.path`) get placeholders marked
required, so the output parses back as a spec that differs from the defaults in nothing else.
"""

from __future__ import annotations

import textwrap
import typing
from typing import Any

import yaml
from pydantic import BaseModel

from asyncrl.spec import ExperimentSpec

PLACEHOLDERS = {"model": {"path": "path/to/hf-model"}, "dataset": {"path": "path/to/train.jsonl"}}
"""Values printed for the fields a user must give."""
WIDTH = 96
"""Longest line of a comment."""


def default_spec() -> ExperimentSpec:
    """The spec with every default, the required paths set to their placeholders."""
    return ExperimentSpec.model_validate(PLACEHOLDERS)


def defaults_yaml() -> str:
    """The default spec as YAML, each field preceded by its description as a comment."""
    lines = [
        "# asyncrl experiment spec: every field with its default (`asyncrl spec --defaults`).",
        "# Fields marked (required) have no default; the JSON Schema with the same descriptions",
        "# is protos/asyncrl/v1/experiment.schema.json.",
    ]
    _section(ExperimentSpec, default_spec().model_dump(mode="json"), 0, lines)
    return "\n".join(lines) + "\n"


def _section(model: type[BaseModel], values: dict, indent: int, lines: list[str]) -> None:
    pad = " " * indent
    for name, field in model.model_fields.items():
        about = " ".join((field.description or "").split())
        if field.is_required():
            about = f"(required) {about}"
        if choices := _choices(field.annotation):
            about += f" One of: {', '.join(choices)}."
        if about:
            wrapped = textwrap.wrap(about, WIDTH - indent - 2, break_on_hyphens=False)
            lines.extend(f"{pad}# {line}" for line in wrapped)
        value = values[name]
        nested = _model_of(field.annotation)
        if nested is not None and isinstance(value, dict):
            lines.append(f"{pad}{name}:")
            _section(nested, value, indent + 2, lines)
        else:
            lines.append(f"{pad}{name}: {_scalar(value)}")


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The spec section a field holds (`X` or `X | None`), or None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _choices(annotation: Any) -> list[str]:
    """The names a Literal field takes; [] for any other field."""
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return []


def _scalar(value: Any) -> str:
    """One value in YAML flow style (`1.0e-05`, `[]`, `{}`, `null`), on one line."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").strip()
