"""The rollout engine's own costs for the system benchmark (bench/system.py): the decode cost
per step against active streams, replayed on the workload's lengths, and the engine's saturated
rate (tokens/s at its best concurrency). Both run the torch engine in the benchmark's process on
one thread, pinned to the cores the supervisor gave the rollout service (`on_cores`): the same
core, measured in the same run, with the cluster idle between experiments.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from asyncrl.spec import SamplingParams
from services.rollout.engine import GenRequest
from services.rollout.torch_engine import TorchEngine

PROBE_CONCURRENCY = (8, 16, 32, 48, 64, 96)
"""Streams the saturation probe tries (the benchmark's fleet has 48 slots)."""
PROBE_TOKENS = 64
"""Tokens each probe stream generates (all the same length: the batch stays full)."""


@contextlib.contextmanager
def on_cores(cores: set[int] | None):
    """This process on `cores` (None: unchanged) and torch on one thread, as the rollout
    service runs (OMP_NUM_THREADS=1), while the block runs."""
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    torch.set_num_threads(1)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


class _TimedEngine(TorchEngine):
    """The torch engine, recording every step: (active streams, seconds, whether it is the
    first step after a weight update, i.e. re-prefills every interrupted request)."""

    def __init__(self, keep_kv: bool = False):
        super().__init__(seed=0, keep_kv_on_update=keep_kv)
        self.step_log: list[tuple[int, float, bool]] = []
        self._resumed = False

    async def _apply(self, op) -> None:
        await super()._apply(op)
        self._resumed = op.kind == "update"

    def _step(self, batch):
        resumed, self._resumed = self._resumed, False
        t0 = time.perf_counter()
        finished = super()._step(batch)
        self.step_log.append((len(batch), time.perf_counter() - t0, resumed))
        return finished


async def _replay(
    model: Path,
    prompt_ids: list[int],
    lengths: list[int],
    slots: int,
    updates: int,
    keep_kv: bool = False,
):
    """Generate `lengths` with at most `slots` in flight; `updates` weight updates (the same
    weights, a new version) at even shares of the tokens, as the fleet gets them mid-run."""
    engine = _TimedEngine(keep_kv)
    await engine.start()
    try:
        await engine.load(str(model), 0)
        gate = asyncio.Semaphore(slots)

        async def one(i: int, length: int):
            async with gate:
                params = SamplingParams(max_new_tokens=length)
                await engine.generate(GenRequest(f"cal-{i}", prompt_ids, params))

        job = asyncio.gather(*(one(i, L) for i, L in enumerate(lengths)))
        for v in range(1, updates + 1):
            share = sum(lengths) * v // (updates + 1)
            while engine.tokens_generated < share and not job.done():
                await asyncio.sleep(0.005)
            if not job.done():
                await engine.update_weights(str(model), v)
        await job
    finally:
        await engine.stop()
    return engine.step_log


@dataclass(frozen=True)
class Decode:
    """The engine's decode cost, t(a) = t0 + c1 a seconds per step at a active streams, and
    what re-prefilling interrupted requests after a weight update adds (not in the model)."""

    t0: float
    c1: float
    steps: int
    resume_stall_s: float
    """Mean extra seconds of the first step after an update, over t(a)."""
    resume_streams: float
    """Mean requests in flight at those updates."""
    full_fleet_step_s: float
    """Mean step with at least 90 % of the slots active, as replayed (model: t(C))."""


def replay_log(
    model: Path,
    prompt_ids: list[int],
    lengths: list[int],
    slots: int,
    updates: int,
    keep_kv: bool = False,
    cores: set[int] | None = None,
) -> list[tuple[int, float, bool]]:
    """Every step of the engine replaying `lengths` at `slots` concurrency on `cores`."""
    with on_cores(cores):
        return asyncio.run(_replay(model, prompt_ids, lengths, slots, updates, keep_kv))


def fit_decode(logs: Sequence[list[tuple[int, float, bool]]], slots: int) -> Decode:
    """t(a) through the fastest of the replays at each occupancy (the per-level median of each
    replay, then the lowest of them: the engine's cost on an undisturbed core)."""
    levels: dict[int, float] = {}
    for log in logs:
        xs, ys = per_level_medians([(a, dt) for a, dt, resumed in log if not resumed])
        for a, y in zip(xs, ys, strict=True):
            levels[a] = min(y, levels.get(a, y))
    xs = sorted(levels)
    t0, c1 = fit_line(xs, [levels[a] for a in xs])
    t0 = max(t0, 1e-6)  # the model needs t0 > 0 (alpha = c1 C / t0)
    resumed = [(a, dt) for log in logs for a, dt, r in log if r]
    stall = float(np.mean([dt - (t0 + c1 * a) for a, dt in resumed])) if resumed else 0.0
    streams = float(np.mean([a for a, _ in resumed])) if resumed else 0.0
    full = [dt for log in logs for a, dt, r in log if not r and a >= 0.9 * slots]
    plain = sum(1 for log in logs for *_, r in log if not r)
    return Decode(t0, c1, plain, stall, streams, float(np.mean(full)) if full else t0 + c1 * slots)


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Theil-Sen (intercept, slope): the median of the pairwise slopes, robust to the outliers
    a shared machine adds (a preempted step). Both kept >= 0: a negative intercept gives the
    median of y/x through the origin instead."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    i, j = np.triu_indices(len(xs), 1)
    dx = xs[j] - xs[i]
    if not np.any(dx != 0):
        return float(np.median(ys)), 0.0
    slope = max(0.0, float(np.median((ys[j] - ys[i])[dx != 0] / dx[dx != 0])))
    intercept = float(np.median(ys - slope * xs))
    if intercept < 0:
        return 0.0, float(np.median(ys[xs > 0] / xs[xs > 0]))
    return intercept, slope


def per_level_medians(points: Sequence[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """The median y at each distinct x (each occupancy level counts once in the fit)."""
    levels: dict[int, list[float]] = {}
    for a, dt in points:
        levels.setdefault(a, []).append(dt)
    xs = sorted(levels)
    return xs, [float(np.median(levels[a])) for a in xs]


# ---------------------------------------------------------------------------- saturation


async def _probe(model: Path, prompt_ids: list[int], levels: Sequence[int], tokens: int):
    engine = TorchEngine(seed=0, max_batch=max(levels))
    await engine.start()
    rates = {}
    try:
        await engine.load(str(model), 0)
        for a in levels:
            params = SamplingParams(max_new_tokens=tokens)
            t0 = time.perf_counter()
            await asyncio.gather(
                *(engine.generate(GenRequest(f"sat-{a}-{i}", prompt_ids, params)) for i in range(a))
            )
            rates[a] = a * tokens / (time.perf_counter() - t0)
    finally:
        await engine.stop()
    return rates


def saturation(
    model: Path,
    prompt_ids: list[int],
    cores: set[int] | None,
    levels: Sequence[int] = PROBE_CONCURRENCY,
    tokens: int = PROBE_TOKENS,
) -> dict[int, float]:
    """Tokens/s of the engine at each concurrency in `levels`: that many streams of `tokens`
    tokens each, started together (prefill included), on `cores`."""
    with on_cores(cores):
        return asyncio.run(_probe(model, prompt_ids, levels, tokens))
