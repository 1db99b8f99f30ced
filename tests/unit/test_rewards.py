"""Reward functions and their registry: exact values, no processes, no sockets."""

from __future__ import annotations

import pytest

from asyncrl import rewards
from asyncrl.rewards import (
    REWARD_FUNCTIONS,
    exact_match,
    last_number,
    math_verify,
    numeric_match,
    regex,
    resolve,
    validate_reward_function,
)
from asyncrl.spec import SpecError

PLUGINS = "tests.fixtures_plugins.rewards"


# exact_match ---------------------------------------------------------------------------------


def test_exact_match_surrounding_whitespace_matches():
    assert exact_match("  Paris\n", "Paris", "q") == 1.0


def test_exact_match_different_text_zero():
    assert exact_match("Paris, France", "Paris", "q") == 0.0


def test_exact_match_case_differs_by_default_zero():
    assert exact_match("paris", "Paris", "q") == 0.0


def test_exact_match_case_insensitive_kwarg_matches():
    assert exact_match("PARIS ", "Paris", "q", case_sensitive="false") == 1.0
    assert exact_match("PARIS ", "Paris", "q", case_sensitive="True") == 0.0


@pytest.mark.parametrize("flag", ["true", "TRUE", " true ", "false", "False", " FALSE\n"])
def test_exact_match_case_sensitive_any_spelling_parsed(flag):
    sensitive = flag.strip().lower() == "true"
    assert exact_match("PARIS", "Paris", "q", case_sensitive=flag) == (0.0 if sensitive else 1.0)
    assert exact_match("Paris", "Paris", "q", case_sensitive=flag) == 1.0


@pytest.mark.parametrize("flag", ["maybe", "", "truee", "1"])
def test_exact_match_bad_bool_kwarg_any_raises_naming_it(flag):
    with pytest.raises(ValueError, match="case_sensitive"):
        exact_match("a", "a", "q", case_sensitive=flag)


def test_exact_match_bad_bool_kwarg_raises_naming_it():
    with pytest.raises(ValueError, match="case_sensitive"):
        exact_match("a", "a", "q", case_sensitive="maybe")


# numeric_match -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("The answer is 72.", 72.0),
        ("first 3, then 5, finally 8", 8.0),
        ("it costs $1,000,000 in total", 1_000_000.0),
        ("1,234.5 apples", 1234.5),
        ("x = -5", -5.0),
        ("\u22124", -4.0),
        ("10-3", 3.0),  # subtraction, not a negative number
        ("3/4 of the cake", 0.75),
        ("-3/4", -0.75),
        ("pi is 3.14159", 3.14159),
        ("about .5", 0.5),
        ("12,34", 34.0),  # not a thousands grouping: two numbers
        ("no digits here", None),
        ("1/0", None),
    ],
)
def test_last_number_forms_parsed(text, value):
    assert last_number(text) == value


def test_numeric_match_thousands_vs_plain_matches():
    assert numeric_match("So she pays 1,000 dollars.", "1000", "q") == 1.0


def test_numeric_match_fraction_vs_decimal_matches():
    assert numeric_match("Each gets 3/4", "0.75", "q") == 1.0


def test_numeric_match_uses_last_number_zero():
    assert numeric_match("The answer is 72, not 73", "72", "q") == 0.0


@pytest.mark.parametrize(
    ("completion", "which", "score"),
    [
        ("46 is larger than 72.", "last", 1.0),  # ends on the answer, names the wrong one
        ("46 is larger than 72.", "first", 0.0),
        ("72 is larger than 46.", "first", 1.0),
        ("The larger number is 72.", "first", 1.0),
        ("72", "first", 1.0),
        ("no number at all", "first", 0.0),
    ],
)
def test_numeric_match_first_or_last_number(completion, which, score):
    assert numeric_match(completion, "72", "Which is larger, 46 or 72?", which=which) == score


def test_numeric_match_which_must_be_first_or_last():
    with pytest.raises(ValueError, match="'which' must be 'first' or 'last', got 'middle'"):
        numeric_match("72", "72", "q", which="middle")


def test_numeric_match_negative_matches():
    assert numeric_match("the temperature drops to -12 degrees", "-12", "q") == 1.0


def test_numeric_match_within_default_tolerance_matches():
    assert numeric_match("0.1000000001", "0.1", "q") == 1.0
    assert numeric_match("0.1001", "0.1", "q") == 0.0


def test_numeric_match_tolerance_kwarg_widens():
    assert numeric_match("3.14", "3.14159", "q", tolerance="0.01") == 1.0
    assert numeric_match("3.2", "3.14159", "q", tolerance="0.01") == 0.0


def test_numeric_match_no_number_in_completion_zero():
    assert numeric_match("I don't know", "5", "q") == 0.0


def test_numeric_match_answer_without_number_raises():
    with pytest.raises(ValueError, match="answer has no number"):
        numeric_match("5", "five", "q")


# math_verify ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("The answer is 0.5", "\\frac{1}{2}"),
        ("so \\boxed{\\frac{1}{2}}", "0.5"),
        ("$\\boxed{1+x^2}$", "x^2+1"),
        ("we get \\boxed{\\sqrt 2}", "\\sqrt{2}"),
        ("\\boxed{\\{2,1\\}}", "\\{1,2\\}"),
        ("the answer is 0.75", "3/4"),
        ("first 3 then \\boxed{7} and then 9", "7"),  # \boxed{} wins over the last number
        ("the total is 1,000", "$1000$"),
    ],
)
def test_math_verify_equivalent_forms_one(completion, answer):
    assert math_verify(completion, answer, "q") == 1.0


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("\\boxed{73}", "72"),
        ("\\boxed{\\frac{1}{3}}", "0.5"),
        ("no answer at all", "5"),
    ],
)
def test_math_verify_different_answers_zero(completion, answer):
    assert math_verify(completion, answer, "q") == 0.0


def test_math_verify_unparseable_answer_raises():
    with pytest.raises(ValueError, match="cannot parse the answer"):
        math_verify("\\boxed{5}", "", "q")


# regex ---------------------------------------------------------------------------------------


def test_regex_search_matches_anywhere():
    assert regex("<think>hm</think> 42", "", "q", pattern=r"</think>\s*\d+") == 1.0


def test_regex_no_match_zero():
    assert regex("42", "", "q", pattern=r"<think>") == 0.0


def test_regex_fullmatch_requires_whole_completion():
    assert regex("answer: 42", "", "q", pattern=r"\d+", fullmatch="true") == 0.0
    assert regex("42", "", "q", pattern=r"\d+", fullmatch="true") == 1.0


def test_regex_missing_pattern_raises_naming_it():
    with pytest.raises(ValueError, match="'pattern'"):
        regex("42", "", "q")


# registry ------------------------------------------------------------------------------------


def test_registry_builtins_listed():
    assert list(REWARD_FUNCTIONS) == ["exact_match", "numeric_match", "math_verify", "regex"]


def test_resolve_builtin_returns_function():
    assert resolve("numeric_match") is numeric_match


def test_resolve_plugin_imports_and_calls():
    fn = resolve(f"plugin:{PLUGINS}:length_at_most")
    assert fn("short", "", "q") == 1.0
    assert fn("much too long", "", "q", max_chars="5") == 0.0


def test_validate_unknown_name_spec_error_lists_known():
    with pytest.raises(SpecError) as e:
        validate_reward_function("exact")
    assert e.value.field == "reward.function"
    assert e.value.reason.startswith("unknown reward function 'exact'; known: exact_match, ")
    assert "math_verify" in e.value.reason


@pytest.mark.parametrize(
    ("name", "detail"),
    [
        ("plugin:no_such_module_xyz:fn", "cannot import no_such_module_xyz: ModuleNotFoundError"),
        (f"plugin:{PLUGINS}:missing", "has no function missing"),
        (f"plugin:{PLUGINS}:NOT_CALLABLE", "has no function NOT_CALLABLE"),
        (f"plugin:{PLUGINS}:two_args", "must take (completion, answer, prompt, **kwargs)"),
        (f"plugin:{PLUGINS}", "plugin:<module>:<fn>"),
        ("plugin::fn", "plugin:<module>:<fn>"),
    ],
)
def test_validate_bad_plugin_spec_error(name, detail):
    with pytest.raises(SpecError) as e:
        validate_reward_function(name)
    assert e.value.field == "reward.function"
    assert f"unknown reward function {name!r}" in e.value.reason
    assert detail in e.value.reason


def test_validate_good_plugin_passes():
    assert validate_reward_function(f"plugin:{PLUGINS}:scripted") is None


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("regex", {}, "needs kwarg 'pattern'"),
        ("regex", {"pattern": "("}, "kwarg 'pattern' is not a valid regex"),
        ("regex", {"pattern": "a", "fullmatch": "yes"}, "kwarg 'fullmatch'"),
        ("exact_match", {"case_sensitive": "no"}, "kwarg 'case_sensitive'"),
        ("numeric_match", {"tolerance": "tiny"}, "kwarg 'tolerance' must be a number"),
        ("numeric_match", {"tolerance": "-1"}, "kwarg 'tolerance' must be finite and >= 0"),
    ],
)
def test_validate_bad_kwargs_spec_error(name, kwargs, message):
    with pytest.raises(SpecError) as e:
        validate_reward_function(name, kwargs)
    assert e.value.field == "reward.kwargs"
    assert message in e.value.reason


def test_validate_good_kwargs_pass():
    validate_reward_function("regex", {"pattern": r"\d+", "fullmatch": "true"})
    validate_reward_function("numeric_match", {"tolerance": "0.01"})
    assert rewards.validate_reward_function("exact_match", {}) is None
