"""`key=value` assignments from a command line: spec overrides (`asyncrl submit --set`) and
engine options (`python -m services.rollout --engine-opt`)."""

from __future__ import annotations

from typing import Any

import yaml

from asyncrl.errors import SpecError


def parse_assignments(
    items: list[str], what: str = "override", example: str = "a.b=value"
) -> list[tuple[str, Any]]:
    """`key=value` strings (value parsed as YAML) -> [(key, value)]; SpecError otherwise."""
    pairs = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(item, f"{what} must look like {example}")
        pairs.append((key.strip(), yaml.safe_load(raw)))
    return pairs


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict in place."""
    for key, value in parse_assignments(overrides):
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return data
