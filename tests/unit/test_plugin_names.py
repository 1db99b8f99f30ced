"""The control plane checks plugin names by syntax only and never imports them."""

from __future__ import annotations

import sys

import pytest

from asyncrl.errors import SpecError
from asyncrl.rewards import check_reward_function
from asyncrl.workflow import check_workflow

MARKER = "tests.fixtures_plugins.marker"


@pytest.mark.parametrize(
    "name",
    ["exact_match", "regex", "plugin:pkg:fn", "plugin:a.b_c.d:f1", f"plugin:{MARKER}:score"],
)
def test_check_reward_function_known_or_plugin_syntax_accepted(name):
    kwargs = {"pattern": "x"} if name == "regex" else None
    check_reward_function(name, kwargs)


@pytest.mark.parametrize(
    "name",
    [
        "no_such_reward",
        "plugin:",
        "plugin:pkg",
        "plugin:pkg:",
        "plugin:pkg..mod:fn",
        "plugin:pkg.:fn",
        "plugin:1pkg:fn",
        "plugin:pkg:fn:extra",
        "plugin:pkg:fn()",
        "plugin:os;rm:fn",
        "pkg:fn",  # a plugin needs the prefix
    ],
)
def test_check_reward_function_bad_name_spec_error_names_field(name):
    with pytest.raises(SpecError) as e:
        check_reward_function(name)
    assert e.value.field == "reward.function"


def test_check_reward_function_bad_builtin_kwargs_spec_error_names_kwargs():
    with pytest.raises(SpecError) as e:
        check_reward_function("regex", {"pattern": "("})
    assert e.value.field == "reward.kwargs"


@pytest.mark.parametrize("name", ["a:B", "pkg.sub_mod:Flow", f"{MARKER}:Marker"])
def test_check_workflow_plugin_syntax_accepted(name):
    check_workflow(name, {"any": "args"})  # a plugin's args are its worker's business


@pytest.mark.parametrize(
    "name", ["no_such_flow", "pkg..mod:Flow", "pkg:", ":Flow", "pkg:Flow.attr", "a b:C", "1a:B"]
)
def test_check_workflow_bad_name_value_error(name):
    with pytest.raises(ValueError, match="unknown workflow"):
        check_workflow(name, {})


def test_check_workflow_builtin_bad_args_value_error():
    with pytest.raises(ValueError, match="rejects its args"):
        check_workflow("multi_turn", {"turns": 2})


def test_checks_never_import_the_plugin():
    assert MARKER not in sys.modules
    check_reward_function(f"plugin:{MARKER}:score")
    check_workflow(f"{MARKER}:Marker", {})
    assert MARKER not in sys.modules
