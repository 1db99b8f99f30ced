"""Reward functions: pure code, no grpc. A reward function is

    fn(completion: str, answer: str, prompt: str, **kwargs: str) -> float

Built-ins are looked up by name in REWARD_FUNCTIONS; `plugin:<module>:<fn>` imports a user
function with the same signature. kwargs are strings (they come from the spec / the Score
request); each function parses its own. A function raises on bad input (a missing kwarg, an
answer that is not a number): the reward service turns that into a FAILED item with the reason,
never a silent 0.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable
from fractions import Fraction

from asyncrl.errors import SpecError
from asyncrl.registry import is_plugin_name

RewardFn = Callable[..., float]

PLUGIN_PREFIX = "plugin:"


def parse_bool(name: str, value: str) -> bool:
    """A boolean kwarg: "true"/"false" (any case)."""
    lowered = value.strip().lower()
    if lowered not in ("true", "false"):
        raise ValueError(f"kwarg '{name}' must be 'true' or 'false', got {value!r}")
    return lowered == "true"


def parse_float(name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"kwarg '{name}' must be a number, got {value!r}") from None


# ---------------------------------------------------------------------------------------------
# exact_match


def exact_match(completion: str, answer: str, prompt: str = "", **kwargs: str) -> float:
    """1.0 when completion and answer are equal after stripping surrounding whitespace.

    kwargs: case_sensitive ("true" | "false", default "true").
    """
    case_sensitive = parse_bool("case_sensitive", kwargs.get("case_sensitive", "true"))
    got, want = completion.strip(), answer.strip()
    if not case_sensitive:
        got, want = got.casefold(), want.casefold()
    return 1.0 if got == want else 0.0


# ---------------------------------------------------------------------------------------------
# numeric_match

# A number as a model writes it: an optional minus sign (not when it follows a term, as in the
# subtraction "10-3"), then a simple fraction "3/4", a thousands-grouped "1,000.5", a plain
# "12" / "12.5", or a bare ".5". A number never starts in the middle of another one.
_NUMBER = re.compile(
    r"(?:(?<![\w.)\]])(?P<sign>[-\u2212]))?"
    r"(?<![\d.])"
    r"(?:"
    r"(?P<num>\d+)/(?P<den>\d+)"
    r"|(?P<grouped>\d{1,3}(?:,\d{3})+(?:\.\d+)?)(?![\d])"
    r"|(?P<plain>\d+(?:\.\d+)?|\.\d+)"
    r")"
)


def _value(m: re.Match) -> float | None:
    if m["den"] is not None:
        if int(m["den"]) == 0:
            return None
        value = float(Fraction(int(m["num"]), int(m["den"])))
    elif m["grouped"] is not None:
        value = float(m["grouped"].replace(",", ""))
    else:
        value = float(m["plain"])
    return -value if m["sign"] else value


def numbers(text: str) -> list[float]:
    """Every number written in `text`, in order (see _NUMBER for the forms)."""
    return [v for v in map(_value, _NUMBER.finditer(text)) if v is not None]


def last_number(text: str) -> float | None:
    """The last number written in `text`, or None."""
    values = numbers(text)
    return values[-1] if values else None


def numeric_match(completion: str, answer: str, prompt: str = "", **kwargs: str) -> float:
    """1.0 when the last (or, with which="first", the first) number in the completion equals
    the answer's number within `tolerance` (absolute, default 1e-6). A completion with no
    number scores 0.0; an answer with no number is an error (bad data, not a wrong completion).

    kwargs: tolerance; which ("last", the default: a worked answer ends on its result, or
    "first": the number a short answer leads with. A question whose answer is one of the
    numbers it asks about wants "first": "46 is larger than 72." ends on the right number
    while it names the wrong one, and a policy trained on "last" learns to say just that,
    see docs/smollm2.md).
    """
    tolerance = parse_float("tolerance", kwargs.get("tolerance", "1e-6"))
    which = kwargs.get("which", "last")
    if which not in ("first", "last"):
        raise ValueError(f"kwarg 'which' must be 'first' or 'last', got {which!r}")
    want = last_number(answer)
    if want is None:
        raise ValueError(f"answer has no number: {answer[:80]!r}")
    found = numbers(completion)
    got = (found[0] if which == "first" else found[-1]) if found else None
    if got is None:
        return 0.0
    return 1.0 if abs(got - want) <= tolerance else 0.0


# ---------------------------------------------------------------------------------------------
# math_verify


def _parse_gold(answer: str) -> list:
    """Parse the gold answer. A bare expression ("x^2+1", "\\sqrt{2}") is read as LaTeX math;
    an answer that already carries delimiters ($...$, \\boxed{}) is parsed as given."""
    from math_verify import parse

    text = answer.strip()
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return parse(text)
    return parse(f"${text}$") or parse(text)


def math_verify(completion: str, answer: str, prompt: str = "", **kwargs: str) -> float:
    """1.0 when HF math-verify finds the completion's answer (its \\boxed{} or last
    expression) mathematically equal to the gold `answer` ("\\frac{1}{2}" == "0.5").
    An answer math-verify cannot parse is an error."""
    from math_verify import parse, verify

    gold = _parse_gold(answer)
    if not gold:
        raise ValueError(f"math_verify cannot parse the answer: {answer[:80]!r}")
    return 1.0 if verify(gold, parse(completion)) else 0.0


# ---------------------------------------------------------------------------------------------
# regex


def regex(completion: str, answer: str, prompt: str = "", **kwargs: str) -> float:
    """1.0 when kwarg `pattern` matches the completion (re.search; kwarg fullmatch="true"
    requires the whole completion to match). `answer` is not used."""
    if "pattern" not in kwargs:
        raise ValueError("regex needs kwarg 'pattern'")
    full = parse_bool("fullmatch", kwargs.get("fullmatch", "false"))
    match = re.fullmatch if full else re.search
    return 1.0 if match(kwargs["pattern"], completion) else 0.0


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "math_verify": math_verify,
    "regex": regex,
}

INLINE = frozenset({"exact_match", "numeric_match"})
"""Built-ins cheap and bounded enough to run on the reward service's event loop: pure string
work, linear in the text (about 0.1 µs per character for numeric_match). Not regex (a user's
pattern can backtrack without bound), not math_verify (sympy), never a plugin."""
INLINE_MAX_CHARS = 4096
"""Longer texts go to the process pool even for an INLINE function (at most ~0.5 ms each)."""


# ---------------------------------------------------------------------------------------------
# registry


def _unknown(name: str, detail: str = "") -> SpecError:
    known = ", ".join([*REWARD_FUNCTIONS, "plugin:<module>:<fn>"])
    reason = f"unknown reward function {name!r}"
    if detail:
        reason += f" ({detail})"
    return SpecError("reward.function", f"{reason}; known: {known}")


def is_plugin(name: str) -> bool:
    """Whether `name` names a plugin reward function, `plugin:<module.path>:<fn>` (by syntax:
    nothing is imported)."""
    return name.startswith(PLUGIN_PREFIX) and is_plugin_name(name.removeprefix(PLUGIN_PREFIX))


def _load_plugin(name: str) -> RewardFn:
    if not is_plugin(name):
        raise _unknown(name, "a plugin is named plugin:<module.path>:<fn>")
    module_name, _, fn_name = name.removeprefix(PLUGIN_PREFIX).partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure makes the name invalid
        raise _unknown(name, f"cannot import {module_name}: {type(e).__name__}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise _unknown(name, f"{module_name} has no function {fn_name}")
    try:
        inspect.signature(fn).bind("completion", "answer", "prompt")
    except TypeError as e:
        raise _unknown(
            name, f"{fn_name} must take (completion, answer, prompt, **kwargs): {e}"
        ) from e
    except ValueError:
        pass  # no introspectable signature (a builtin): trust it
    return fn


def resolve(name: str) -> RewardFn:
    """The reward function called `name`; SpecError('reward.function', ...) if there is none."""
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    if name.startswith(PLUGIN_PREFIX):
        return _load_plugin(name)
    raise _unknown(name)


def validate_reward_function(name: str, kwargs: dict[str, str] | None = None) -> None:
    """Raise SpecError unless `name` resolves (a plugin is imported); with `kwargs`, also check
    the built-ins' kwargs (regex needs a valid `pattern`; booleans and numbers must parse).
    For the worker that runs the function; the control plane uses `check_reward_function`."""
    resolve(name)
    _check_kwargs_or_raise(name, kwargs)


def check_reward_function(name: str, kwargs: dict[str, str] | None = None) -> None:
    """Check `name` without importing anything: a built-in (and its `kwargs`), or
    `plugin:<module.path>:<fn>` by syntax only; SpecError naming the field otherwise. The
    reward worker imports a plugin when the experiment binds there, and refuses it then."""
    if name in REWARD_FUNCTIONS:
        _check_kwargs_or_raise(name, kwargs)
        return
    if not is_plugin(name):
        raise _unknown(name, "a plugin is named plugin:<module.path>:<fn>")


def _check_kwargs_or_raise(name: str, kwargs: dict[str, str] | None) -> None:
    if kwargs is None:
        return
    try:
        _check_kwargs(name, kwargs)
    except (ValueError, re.error) as e:
        raise SpecError("reward.kwargs", str(e)) from e


def _check_kwargs(name: str, kwargs: dict[str, str]) -> None:
    if name == "exact_match":
        parse_bool("case_sensitive", kwargs.get("case_sensitive", "true"))
    elif name == "numeric_match":
        tolerance = parse_float("tolerance", kwargs.get("tolerance", "1e-6"))
        if not (math.isfinite(tolerance) and tolerance >= 0):
            raise ValueError(f"kwarg 'tolerance' must be finite and >= 0, got {tolerance}")
    elif name == "regex":
        if "pattern" not in kwargs:
            raise ValueError("regex needs kwarg 'pattern'")
        parse_bool("fullmatch", kwargs.get("fullmatch", "false"))
        try:
            re.compile(kwargs["pattern"])
        except re.error as e:
            raise ValueError(f"kwarg 'pattern' is not a valid regex: {e}") from e
