"""A workflow and a reward function that must never be imported by the scheduler: the test
that submits them checks that this module is not in the scheduler's `sys.modules`."""

from __future__ import annotations

from asyncrl.workflow import SingleTurn

IMPORTED = True


class Marker(SingleTurn):
    """The built-in single turn, under a plugin name."""


def score(completion: str, answer: str, prompt: str, **kwargs: str) -> float:
    return float(completion.strip() == answer.strip())
