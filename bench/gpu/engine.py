"""Part `engine`: the embedded torch engine (`TorchEngine`, fp32) on the device.

1. Throughput: `concurrency` requests of `prompt_len` random tokens, `max_new_tokens` each
   (temperature 1: a random-weight model almost never samples EOS, so every request runs to
   its length), submitted at once after a warm-up; tokens/s = output tokens / wall time.
2. Interrupt: the same load again; once about a third of the tokens are out, `update_weights`
   to a second random model (version 1) at the next token boundary. Every request must finish
   with versions 0...0 1...1 (monotone, both present); the update's phases are reported, and
   the logprobs the engine recorded are checked against a plain HF forward of the whole
   sequence under the version that produced each token (max and mean |diff|).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from asyncrl.spec import SamplingParams
from bench.gpu.shapes import SHAPES, build
from services.rollout.engine import GenRequest


def run(shape: str, work: Path, sizes: dict, device: str) -> dict:
    return asyncio.run(_run(shape, work, sizes, device))


def _requests(tag: str, vocab: int, sizes: dict) -> list[GenRequest]:
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=sizes["max_new_tokens"])
    return [
        GenRequest(
            rid=f"{tag}-{i}",
            input_ids=torch.randint(
                4, min(vocab, 99), (sizes["prompt_len"],), generator=g
            ).tolist(),
            params=params,
        )
        for i in range(sizes["concurrency"])
    ]


async def _run(shape: str, work: Path, sizes: dict, device: str) -> dict:
    from services.rollout.torch_engine import TorchEngine

    v0 = build(shape, work / "models" / shape)
    v1 = build(shape, work / "models" / f"{shape}-v1", seed=1)
    vocab = SHAPES[shape]["vocab_size"]
    engine = TorchEngine(device=device, seed=0)
    await engine.start()
    try:
        await engine.load(str(v0), version=0)
        warm = dict(sizes, concurrency=min(8, sizes["concurrency"]), max_new_tokens=8)
        await engine.generate_many(_requests("warm", vocab, warm))
        result = {"shape": shape, "device": device, **sizes}
        result.update(await _throughput(engine, vocab, sizes))
        result["interrupt"] = await _interrupt(engine, vocab, sizes, v1)
        result["interrupt"]["logprob_check"] = _logprob_check(
            result["interrupt"].pop("outputs"), v0, v1, device
        )
        return result
    finally:
        await engine.stop()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def _throughput(engine, vocab: int, sizes: dict) -> dict:
    reqs = _requests("tput", vocab, sizes)
    steps0, stats0 = engine.steps, engine.stats()
    t0 = time.perf_counter()
    outs = await engine.generate_many(reqs)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.output_ids) for o in outs)
    stats = engine.stats()
    steps = engine.steps - steps0
    return {
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "decode_steps": steps,
        "step_ms": round(1000 * (stats["step_seconds"] - stats0["step_seconds"]) / steps, 3),
        "prefill_s": round(stats["prefill_seconds"] - stats0["prefill_seconds"], 4),
    }


async def _interrupt(engine, vocab: int, sizes: dict, v1: Path) -> dict:
    reqs = _requests("intr", vocab, sizes)
    at = engine.tokens_generated + len(reqs) * sizes["max_new_tokens"] // 3
    task = asyncio.ensure_future(engine.generate_many(reqs))
    while engine.tokens_generated < at and not task.done():
        await asyncio.sleep(0.001)
    t0 = time.perf_counter()
    interrupted = await engine.update_weights(str(v1), version=1)
    update_s = time.perf_counter() - t0
    outs = await task
    mixed = sum(1 for o in outs if set(o.versions) == {0, 1})
    monotone = all(o.versions == sorted(o.versions) for o in outs)
    phases = engine.last_update
    return {
        "interrupted": interrupted,
        "requests": len(outs),
        "mixed_version_outputs": mixed,
        "versions_monotone": monotone,
        "interruptions_recorded": sum(o.interruptions for o in outs),
        "update_s": round(update_s, 4),
        "read_s": round(phases.read_s, 4),
        "pause_s": round(phases.pause_s, 4),
        "load_s": round(phases.load_s, 4),
        "resume_s": round(phases.resume_s, 4),
        "ok": interrupted > 0 and mixed == len(outs) and monotone,
        "outputs": [(r.input_ids, o) for r, o in zip(reqs, outs, strict=True)],
    }


@torch.no_grad()
def _logprob_check(outputs, v0: Path, v1: Path, device: str) -> dict:
    """The engine's recorded logprobs against an fp32 HF forward of prompt + output under the
    version that produced each token (first 8 requests)."""
    from transformers import AutoModelForCausalLM

    diffs: list[torch.Tensor] = []
    models = {
        v: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).to(device).eval()
        for v, d in ((0, v0), (1, v1))
    }
    for prompt, out in outputs[:8]:
        ids = torch.tensor([prompt + out.output_ids], device=device)
        versions = torch.tensor(out.versions, device=device)
        recorded = torch.tensor(out.logprobs, device=device)
        p = len(prompt)
        for v, model in models.items():
            logits = model(input_ids=ids).logits[0, p - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, p:, None])[:, 0]
            mine = versions == v
            diffs.append((lp[mine] - recorded[mine]).abs())
    d = torch.cat(diffs)
    return {"tokens": d.numel(), "max_abs": float(d.max()), "mean_abs": float(d.mean())}
