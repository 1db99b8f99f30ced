"""A gate for the tests that act on a generation under way (a weight update, a cancel, an abort,
a new bind, the same group dispatched again): the torch engine's worker thread holds at a token
boundary until the engine loop has news, so the requests are still generating when the test's
call reaches the engine, however fast the engine runs or however slowly the test gets there.

Without it such a test raced the engine: the tiny model generates 150 tokens in about 0.1 s, and
a test that saw a group's first tokens then sent its call could find the group finished."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from services.rollout.torch_engine import TorchEngine

HOLD_LIMIT_S = 60.0
"""The longest hold: a call that never reaches the engine fails its test instead of hanging it."""


def hold_generation(engine: TorchEngine, ready: Callable[[], bool]) -> threading.Event:
    """From the first token boundary at which `ready()` holds (read in the worker thread, e.g.
    `engine.tokens_generated >= n`) and no news is pending, `engine` generates nothing until its
    loop has news (a request queued or dropped, a model change due, the engine stopping); then
    one more step, as a run in the worker thread ends at its next boundary, and on as before.
    Once per call. Returns an Event set when the hold begins: the requests are under way and
    held. (News pending at a boundary, e.g. requests queued but not yet in the batch, is the
    loop's first: the hold waits for the boundary after it.)"""
    step = engine._step
    held = threading.Event()

    def gated(batch):
        if not held.is_set() and not engine._news and ready():
            held.set()
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not engine._news and time.monotonic() < deadline:
                time.sleep(0.001)  # the worker thread's wait for the loop's flag
        return step(batch)

    engine._step = gated
    return held
