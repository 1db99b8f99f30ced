"""The math recipe's reward: the final answer of a worked solution, compared as a number.

    reward:
      function: plugin:examples.math.reward:final_answer
      kwargs: {tolerance: "1e-6"}     # absolute; optional

The final answer of a text (`final_answer_of`) is, first found:
1. the first number after the last `####` (GSM8K's own marker: `... #### 72`);
2. the first number in the last `\\boxed{...}` (`\\frac{a}{b}` read as a/b, `{,}` as a
   thousands separator);
3. the last number in the text.

The gold answer is read the same way (a GSM8K `answer` field ends `#### N`; a prepared row's
answer is N itself). Numbers are read as `asyncrl.rewards.numbers` reads them: `1,000`,
`-5`, `3.5`, `3/4`. 1.0 when completion and gold are equal within `tolerance`, 0.0 when they
differ or the completion has no number; a gold answer without a number raises (bad data: the
sample is FAILED, never a silent 0). For LaTeX answers that are not numbers (MATH, AIME with
expressions) use the built-in `math_verify`.
"""

from __future__ import annotations

import re

from asyncrl.rewards import numbers, parse_float

_MARKER = "####"
_BOXED = "\\boxed"
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def _boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (nested braces balanced), or None."""
    start = text.rfind(_BOXED + "{")
    if start < 0:
        return None
    depth, begin = 0, start + len(_BOXED)
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin + 1 : i]
    return None  # never closed


def _latex_numbers(text: str) -> list[float]:
    """Numbers of a LaTeX fragment: `\\frac{3}{4}` as 3/4, `1{,}000` as 1,000."""
    text = _FRAC.sub(r"(\1)/(\2)", text).replace("{,}", ",")
    text = re.sub(r"\((-?[\d.]+)\)/\((-?[\d.]+)\)", r"\1/\2", text)
    return numbers(text)


def final_answer_of(text: str) -> float | None:
    """The final answer written in `text` (see the module docstring for the order), or None."""
    if _MARKER in text:
        after = numbers(text[text.rindex(_MARKER) + len(_MARKER) :])
        if after:
            return after[0]
    boxed = _boxed(text)
    if boxed is not None:
        inside = _latex_numbers(boxed)
        if inside:
            return inside[0]
    found = numbers(text)
    return found[-1] if found else None


def final_answer(completion: str, answer: str, prompt: str = "", **kwargs: str) -> float:
    """1.0 when the completion's final answer equals the gold answer's within `tolerance`."""
    tolerance = parse_float("tolerance", kwargs.get("tolerance", "1e-6"))
    want = final_answer_of(answer)
    if want is None:
        raise ValueError(f"answer has no number: {answer[:80]!r}")
    got = final_answer_of(completion)
    return 1.0 if got is not None and abs(got - want) <= tolerance else 0.0
