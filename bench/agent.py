"""What the OpenAI-compatible endpoint costs an agent workflow.

N agents run concurrently, each a two-turn chat (answer, get asked "sure?", answer again) on
the tiny model with the character tokenizer's chat template. Two ways, same engine, same
seeds, same tokens:
- through the endpoint, with the official `openai` SDK (HTTP on 127.0.0.1, JSON both ways,
  the SDK's own request building and parsing);
- as plain JSON over one shared aiohttp session (the endpoint's own cost: HTTP, JSON);
- directly with `ChatSession.send` in the workflow (no HTTP), the peer.
Time ratio = what the endpoint (and the SDK) add to a whole agent rollout, generation
included. The tiny model generates in milliseconds, so this is close to the worst case; with a
real model generation dominates. Most of the SDK's extra is building the client (httpx loads
the CA bundle, ~20 ms here): build one per agent, not per request.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from transformers import AutoTokenizer

from asyncrl.spec import SamplingParams
from asyncrl.tiny import CHAT_TEMPLATE
from asyncrl.workflow import Trajectory, WorkflowContext
from bench.report import Context, Result
from services.rollout.engine import GenRequest
from services.rollout.openai_api import OpenAIEndpoint
from services.rollout.torch_engine import TorchEngine

NAME = "agent"
FOLLOW_UP = "sure?"


def _context(engine: TorchEngine, tok, i: int, params: SamplingParams) -> WorkflowContext:
    prompt = f"{i % 10}+{i % 7}="
    chat_prompt = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )

    async def generate(rid, input_ids, p):
        out = await engine.generate(GenRequest(rid, input_ids, p, [tok.eos_token_id]))
        out.text = tok.decode(out.output_ids, skip_special_tokens=True)
        return out

    return WorkflowContext(
        prompt=prompt, answer="", prompt_ids=tok.encode(chat_prompt, add_special_tokens=False),
        index=i, is_eval=False, params=params, tokenizer=tok, generate=generate, score=None,
        version=lambda: engine.version, request_id=f"a{i}", chat_prompt=chat_prompt,
    )  # fmt: skip


async def _direct(ctx: WorkflowContext) -> Trajectory:
    traj = Trajectory()
    chat = ctx.chat(traj)
    messages = [{"role": "user", "content": ctx.prompt}]
    reply = await chat.send(messages)
    messages += [
        {"role": "assistant", "content": reply.text},
        {"role": "user", "content": FOLLOW_UP},
    ]
    await chat.send(messages)
    return traj


async def _via_sdk(ctx: WorkflowContext, endpoint: OpenAIEndpoint) -> Trajectory:
    import openai

    traj = Trajectory()
    async with endpoint.session(ctx.chat(traj)) as client_args:
        async with openai.AsyncOpenAI(**client_args, max_retries=0) as llm:
            messages = [{"role": "user", "content": ctx.prompt}]
            r = await llm.chat.completions.create(model="policy", messages=messages)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": FOLLOW_UP},
            ]
            await llm.chat.completions.create(model="policy", messages=messages)
    return traj


async def _via_http(ctx: WorkflowContext, endpoint: OpenAIEndpoint, http) -> Trajectory:
    """The same two requests as JSON over one shared aiohttp session: the endpoint's own
    cost (HTTP, JSON, the session lookup) without the SDK's client construction."""
    traj = Trajectory()
    async with endpoint.session(ctx.chat(traj)) as client_args:
        url = client_args["base_url"] + "/chat/completions"
        headers = {"Authorization": f"Bearer {client_args['api_key']}"}
        messages = [{"role": "user", "content": ctx.prompt}]
        for follow_up in (FOLLOW_UP, None):
            body = {"model": "policy", "messages": messages}
            async with http.post(url, json=body, headers=headers) as resp:
                reply = (await resp.json())["choices"][0]["message"]["content"]
            if follow_up:
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": follow_up},
                ]
    return traj


async def _measure(model, tok, n: int, params: SamplingParams, repeats: int):
    engine = TorchEngine(seed=0)
    endpoint = OpenAIEndpoint()
    await engine.start()
    times: dict[str, list[float]] = {"direct": [], "http": [], "sdk": []}
    tokens: dict[str, int] = {}
    http = aiohttp.ClientSession()
    try:
        await engine.load(str(model), 0)
        for rep in range(repeats + 1):  # round 0 warms up
            for way in ("direct", "http", "sdk"):
                ctxs = [_context(engine, tok, i, params) for i in range(n)]
                t0 = time.perf_counter()
                if way == "direct":
                    trajs = await asyncio.gather(*(_direct(c) for c in ctxs))
                elif way == "http":
                    trajs = await asyncio.gather(*(_via_http(c, endpoint, http) for c in ctxs))
                else:
                    trajs = await asyncio.gather(*(_via_sdk(c, endpoint) for c in ctxs))
                elapsed = time.perf_counter() - t0
                tokens[way] = sum(len(t.output_ids) for t in trajs)
                if rep:
                    times[way].append(elapsed)
    finally:
        await http.close()
        await endpoint.stop()
        await engine.stop()
    return {way: min(t) for way, t in times.items()}, tokens


def run(ctx: Context) -> list[Result]:
    n = ctx.size(16, 2)
    repeats = ctx.size(3, 1)
    params = SamplingParams(temperature=1.0, max_new_tokens=ctx.size(24, 4))
    model = ctx.tiny_model(seed=0)
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.chat_template = CHAT_TEMPLATE
    best, tokens = asyncio.run(_measure(model, tok, n, params, repeats))
    settings = {
        "agents": n,
        "turns": 2,
        "max_new_tokens": params.max_new_tokens,
        "trajectory_tokens": tokens,  # equal: same seeds and request ids both ways
        "repeats": repeats,
        "model": ctx.model_config() or "tiny default",
    }
    peer = "the same agents calling ChatSession directly"
    return [
        Result(NAME, f"{n} two-turn agents, JSON over HTTP to the endpoint", best["http"], "s",
               peer, best["direct"], settings),
        Result(NAME, f"{n} two-turn agents, a new OpenAI SDK client each", best["sdk"], "s",
               peer, best["direct"], settings),
    ]  # fmt: skip
