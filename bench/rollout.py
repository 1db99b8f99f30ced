"""Rollout engine throughput: one group of n concurrent requests through TorchEngine.

Peers, on the same prompts and the same number of new tokens:
- the same engine without the KV cache (every step recomputes every sequence), and
- a plain sequential loop of HuggingFace `model.generate` (KV cache, one request at a time):
  what continuous batching buys.

And a full batch (a wave of short requests, the shape of the demo's rollouts) against the same
model's batched forwards alone (one prefill, then one single-token forward per new token, the
next token its argmax): what the engine's own work per token (sampling, bookkeeping) costs.

No request stops early (no stop tokens; HF generate gets min_new_tokens), so every side
produces exactly n * max_new_tokens tokens. The KV-cache group time is kept in the context
(`group_seconds`): the admission benchmark compares the scheduler's per-group cost with it.
"""

from __future__ import annotations

import asyncio
import time

import torch

from asyncrl.spec import SamplingParams
from bench.report import Context, Result, best_of
from services.rollout.engine import GenRequest
from services.rollout.torch_engine import TorchEngine

NAME = "rollout"


def prompts(n: int, length: int, vocab_lo: int = 4, vocab_hi: int = 90) -> list[list[int]]:
    """n different prompts of length..length+n-1 tokens (deterministic)."""
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(vocab_lo, vocab_hi, (length + i,), generator=g).tolist() for i in range(n)
    ]


async def _engine_group(model_dir, batch: list[list[int]], params, kv_cache: bool, repeats: int):
    """Best wall time of generating the whole batch concurrently, and the tokens produced."""
    engine = TorchEngine(seed=0, kv_cache=kv_cache)
    await engine.start()
    try:
        await engine.load(str(model_dir), 0)
        best, tokens = float("inf"), 0
        for rep in range(repeats + 1):  # the first round warms up (allocator, lazy imports)
            reqs = [GenRequest(f"r{rep}-{i}", p, params) for i, p in enumerate(batch)]
            t0 = time.perf_counter()
            outs = await asyncio.gather(*[engine.generate(r) for r in reqs])
            elapsed = time.perf_counter() - t0
            if rep:
                best = min(best, elapsed)
                tokens = sum(len(o.output_ids) for o in outs)
        return best, tokens
    finally:
        await engine.stop()


def _hf_sequential(model_dir, batch: list[list[int]], max_new_tokens: int, repeats: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    produced = []

    def loop():
        produced.clear()
        with torch.no_grad():
            for p in batch:
                ids = torch.tensor([p])
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    max_new_tokens=max_new_tokens,
                    min_new_tokens=max_new_tokens,
                    pad_token_id=model.config.pad_token_id,
                )
                produced.append(out.shape[1] - ids.shape[1])

    loop()  # warm-up
    return best_of(loop, repeats), sum(produced)


def _forward_bound(model_dir, batch: list[list[int]], max_new_tokens: int, repeats: int):
    """Best wall time of the batched forwards alone (equal-length prompts, KV cache, argmax)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor(batch)

    def loop():
        with torch.no_grad():
            cache = DynamicCache()
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            for _ in range(max_new_tokens - 1):
                step = logits[:, -1:].argmax(dim=-1)
                logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits

    loop()  # warm-up
    return best_of(loop, repeats), len(batch) * max_new_tokens


def _wave(ctx: Context, model_dir) -> Result:
    """A full engine batch of short requests against the batched forwards alone."""
    n, max_new, prompt_len = ctx.size(256, 16), ctx.size(8, 4), ctx.size(10, 4)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(4, 90, (n, prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new)
    engine_s, tokens = asyncio.run(_engine_group(model_dir, batch, params, True, ctx.repeats))
    bound_s, bound_tokens = _forward_bound(model_dir, batch, max_new, ctx.repeats)
    assert tokens == bound_tokens, (tokens, bound_tokens)
    settings = {
        "concurrent_requests": n,
        "prompt_tokens": prompt_len,
        "max_new_tokens": max_new,
        "repeats": ctx.repeats,
        "model": ctx.model_config() or "tiny default",
    }
    return Result(
        NAME,
        "TorchEngine tokens/s, a full batch",
        tokens / engine_s,
        "tok/s",
        "the batched forwards alone (HF, KV cache, argmax)",
        bound_tokens / bound_s,
        settings,
    )


def _sizes(ctx: Context) -> tuple[int, int, int]:
    """(requests in the group, max_new_tokens, shortest prompt)."""
    return ctx.size(8, 2), ctx.size(64, 8), ctx.size(24, 4)


def group_seconds(ctx: Context) -> float:
    """Wall time of one group on the KV-cache engine: this run's measurement, else measured."""
    if "group_seconds" not in ctx.shared:
        n, max_new, prompt_len = _sizes(ctx)
        params = SamplingParams(temperature=1.0, max_new_tokens=max_new)
        batch = prompts(n, prompt_len)
        secs, _ = asyncio.run(_engine_group(ctx.tiny_model(), batch, params, True, ctx.repeats))
        ctx.shared["group_seconds"] = secs
    return ctx.shared["group_seconds"]


def run(ctx: Context) -> list[Result]:
    n, max_new, prompt_len = _sizes(ctx)
    model_dir = ctx.tiny_model()
    batch = prompts(n, prompt_len)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new)

    kv_s, kv_tok = asyncio.run(_engine_group(model_dir, batch, params, True, ctx.repeats))
    nokv_s, nokv_tok = asyncio.run(_engine_group(model_dir, batch, params, False, ctx.repeats))
    hf_s, hf_tok = _hf_sequential(model_dir, batch, max_new, ctx.repeats)
    assert kv_tok == nokv_tok == hf_tok == n * max_new, (kv_tok, nokv_tok, hf_tok)
    ctx.shared["group_seconds"] = kv_s

    settings = {
        "concurrent_requests": n,
        "prompt_tokens": f"{prompt_len}..{prompt_len + n - 1}",
        "max_new_tokens": max_new,
        "tokens_per_run": kv_tok,
        "repeats": ctx.repeats,
        "model": ctx.model_config() or "tiny default",
    }
    kv_rate = kv_tok / kv_s
    return [
        Result(
            NAME,
            "TorchEngine tokens/s, KV cache",
            kv_rate,
            "tok/s",
            "TorchEngine without KV cache",
            nokv_tok / nokv_s,
            settings,
        ),
        Result(
            NAME,
            "TorchEngine tokens/s, KV cache",
            kv_rate,
            "tok/s",
            "sequential HF model.generate",
            hf_tok / hf_s,
            settings,
        ),
        _wave(ctx, model_dir),
    ]
