"""Reward plugins used by the reward tests: plugin:tests.fixtures_plugins.rewards:<fn>."""

from __future__ import annotations

import os
import time
import zlib

from asyncrl.rewards import exact_match


def scripted(completion: str, answer: str, prompt: str, **kwargs: str):
    """Does what the completion says, so one batch can mix behaviours:
    "sleep <s>" sleeps s seconds then returns 1.0, "raise" raises ValueError, "nan" returns
    NaN, "text" returns a string, "exit" kills the worker process; anything else returns
    float(answer)."""
    if completion.startswith("sleep "):
        time.sleep(float(completion.split()[1]))
        return 1.0
    if completion == "raise":
        raise ValueError("scripted failure")
    if completion == "nan":
        return float("nan")
    if completion == "exit":
        os._exit(3)
    if completion == "text":
        return "1.0"
    return float(answer)


def length_at_most(completion: str, answer: str, prompt: str, **kwargs: str) -> float:
    """1.0 when the completion is at most `max_chars` (kwarg, default 10) characters long."""
    return 1.0 if len(completion) <= int(kwargs.get("max_chars", "10")) else 0.0


def two_args(completion: str, answer: str) -> float:
    """Malformed: does not accept the prompt."""
    return 1.0


NOT_CALLABLE = 3


def sleep_forever(completion: str, answer: str, prompt: str, **kwargs: str) -> float:
    """A plugin that hangs: never returns (the reward service kills it at its timeout_s)."""
    while True:
        time.sleep(3600)


def exact_or_hang(completion: str, answer: str, prompt: str, **kwargs: str) -> float:
    """exact_match, except that it hangs forever on every sample of 1 in `one_in` (kwarg,
    default 8) prompts (chosen by the prompt's CRC-32): those groups fail whole, the others
    train (the chaos scenario hung-reward)."""
    if zlib.crc32(prompt.encode()) % int(kwargs.get("one_in", "8")) == 0:
        sleep_forever(completion, answer, prompt)
    return exact_match(completion, answer, prompt)


def coin(completion: str, answer: str, prompt: str, **kwargs: str) -> float:
    """1.0 or 0.0 by a checksum of the completion: rewards that differ inside a group of a
    random model (which never gets an exact match), so each step has a gradient."""
    return float(zlib.crc32(completion.encode()) % 2)
