"""Interruption cost: TorchEngine.update_weights with N requests in flight.

Measured (best of `repeats`), with the update issued once the requests are half done:
- the latency of `update_weights` as the caller sees it (read the safetensors, wait for the
  token boundary, copy into the live model, drop the in-flight KV caches);
- the end-to-end overhead on the batch: wall time of the batch with one update minus without
  (this adds the resume: every request re-prefills prompt + partial output under v+1).
The peer is a plain state-dict load of the same weights into an HF model (safetensors read +
`load_state_dict`): the least any weight update can cost. Ratio = interruption overhead.
"""

from __future__ import annotations

import asyncio
import time

import torch

from asyncrl.natsutil import wait_until
from asyncrl.spec import SamplingParams
from bench.report import Context, Result, best_of
from bench.rollout import prompts
from services.rollout.engine import GenRequest
from services.rollout.torch_engine import TorchEngine, load_state_dict_files

NAME = "interrupt"


async def _measure(v0, v1, batch, params, repeats: int) -> tuple[float, float, float, int]:
    """(best update latency, best batch time with an update, best without, interrupted)."""
    engine = TorchEngine(seed=0)
    await engine.start()
    half = len(batch) * params.max_new_tokens // 2
    latency, with_update, without, interrupted = [], [], [], 0
    try:
        await engine.load(str(v0), 0)
        version = 0
        for rep in range(repeats + 1):  # round 0 warms up
            for update in (False, True):
                reqs = [GenRequest(f"r{rep}{update}-{i}", p, params) for i, p in enumerate(batch)]
                start_tokens = engine.tokens_generated
                t0 = time.perf_counter()
                tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
                if update:
                    await wait_until(
                        lambda s=start_tokens: engine.tokens_generated - s >= half,
                        timeout=60,
                        interval=0.0005,
                    )
                    version += 1
                    t1 = time.perf_counter()
                    interrupted = await engine.update_weights(
                        str(v1 if version % 2 else v0), version
                    )
                    lat = time.perf_counter() - t1
                await asyncio.gather(*tasks)
                elapsed = time.perf_counter() - t0
                if rep:
                    (with_update if update else without).append(elapsed)
                    if update:
                        latency.append(lat)
    finally:
        await engine.stop()
    return min(latency), min(with_update), min(without), interrupted


def _plain_load_seconds(v1, repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(v1), dtype=torch.float32).eval()

    def load():
        with torch.no_grad():
            model.load_state_dict(load_state_dict_files(v1), strict=False)

    load()  # warm-up (page cache)
    return best_of(load, repeats)


def run(ctx: Context) -> list[Result]:
    n = ctx.size(8, 2)
    max_new = ctx.size(64, 8)
    repeats = ctx.size(5, 1)
    v0, v1 = ctx.tiny_model(seed=0), ctx.tiny_model(seed=1)
    batch = prompts(n, ctx.size(24, 4))
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new)

    latency, with_update, without, interrupted = asyncio.run(
        _measure(v0, v1, batch, params, repeats)
    )
    plain = _plain_load_seconds(v1, repeats)
    settings = {
        "in_flight": n,
        "interrupted": interrupted,
        "max_new_tokens": max_new,
        "update_after_tokens": n * max_new // 2,
        "repeats": repeats,
        "batch_seconds_without_update": round(without, 4),
        "model": ctx.model_config() or "tiny default",
    }
    peer = "plain state-dict load (safetensors + load_state_dict)"
    return [
        Result(NAME, f"update_weights latency, {n} in flight", latency, "s", peer, plain, settings),
        Result(
            NAME,
            "batch time added by one interrupt+resume",
            with_update - without,  # may dip below 0 when the noise exceeds the cost
            "s",
            peer,
            plain,
            settings,
        ),
    ]
