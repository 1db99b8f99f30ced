"""The rollout's OpenAI-compatible endpoint over real HTTP, driven by the official `openai` SDK:
replies come from the chat session's engine (also streamed), sampling fields reach it, and
what the policy cannot honour is a 400 naming the field (401 for an unknown key)."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import openai
import pytest

from asyncrl.workflow import Trajectory
from services.rollout.openai_api import OpenAIEndpoint
from tests.fakes import chat_env
from tests.fakes.chat_env import chat_context, enc

tok = chat_env.tok  # the tiny character tokenizer with a chat template (a fixture)


@pytest.fixture
async def endpoint():
    ep = OpenAIEndpoint()
    yield ep
    await ep.stop()


async def test_sdk_two_turns_build_one_trajectory_with_sampling_overrides(tok, endpoint):
    eos = tok.eos_token_id
    ctx, calls = chat_context(tok, [enc(tok, "3") + [eos], enc(tok, "22")])
    traj = Trajectory()
    async with endpoint.session(ctx.chat(traj)) as client_args:
        client = openai.AsyncOpenAI(**client_args, max_retries=0)
        messages = [{"role": "user", "content": "1+1="}]
        first = await client.chat.completions.create(
            model="policy", messages=messages, temperature=0.5, max_tokens=6
        )
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "sure?"},
        ]
        second = await client.chat.completions.create(
            model="policy", messages=messages, stop=["x"], max_completion_tokens=2
        )
        await client.close()
    assert first.choices[0].message.content == "3"
    assert first.choices[0].finish_reason == "stop"
    assert first.usage.prompt_tokens == len(ctx.prompt_ids) and first.usage.completion_tokens == 2
    assert second.choices[0].message.content == "22"
    assert second.choices[0].finish_reason == "length"
    assert (calls[0][1].temperature, calls[0][1].max_new_tokens) == (0.5, 6)
    assert (calls[1][1].max_new_tokens, calls[1][1].stop) == (2, ["x"])
    env = enc(tok, "u:sure?<eos>a:")
    assert traj.output_ids == enc(tok, "3") + [eos] + env + enc(tok, "22")
    assert traj.loss_mask == [1, 1] + [0] * len(env) + [1, 1]


async def test_sdk_bad_requests_are_400_naming_the_field_unknown_key_401(tok, endpoint):
    ctx, _ = chat_context(tok, [enc(tok, "3")])
    async with endpoint.session(ctx.chat(Trajectory())) as client_args:
        client = openai.AsyncOpenAI(**client_args, max_retries=0)
        msgs = [{"role": "user", "content": "1+1="}]
        for bad, param in (({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens")):
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="policy", messages=msgs, **bad)
            assert err.value.body["param"] == param and param in err.value.body["message"]
        tool = {"type": "function", "function": {"name": "calc", "parameters": {}}}
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="policy", messages=msgs, tools=[tool])
        assert err.value.body["param"] == "tools"
        with pytest.raises(openai.BadRequestError) as err:  # history the trajectory never had
            await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "2+2="}]
            )
        assert err.value.body["param"] == "messages"
        assert "does not extend" in err.value.body["message"]
        stranger = openai.AsyncOpenAI(base_url=client_args["base_url"], api_key="nope")
        with pytest.raises(openai.AuthenticationError):
            await stranger.chat.completions.create(model="policy", messages=msgs)
        async with aiohttp.ClientSession() as http:
            async with http.post(
                client_args["base_url"] + "/chat/completions",
                data="{not json",
                headers={"Authorization": f"Bearer {client_args['api_key']}"},
            ) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == "body"
        await client.close()
        await stranger.close()
    # the session ended with the block: its key is refused
    late = openai.AsyncOpenAI(**client_args, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await late.chat.completions.create(model="policy", messages=msgs)
    await late.close()


async def test_sdk_stream_yields_the_reply_then_finish_and_usage(tok, endpoint):
    eos = tok.eos_token_id
    ctx, _ = chat_context(tok, [enc(tok, "42") + [eos]])
    traj = Trajectory()
    async with endpoint.session(ctx.chat(traj)) as client_args:
        async with openai.AsyncOpenAI(**client_args, max_retries=0) as client:
            stream = await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "1+1="}],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == "42" and finishes[-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 3
    assert traj.output_ids == enc(tok, "42") + [eos]


async def test_client_gone_mid_request_cancels_the_generation(tok, endpoint):
    """A workflow cancelled while its agent waits (group aborted) drops the HTTP request; the
    handler is cancelled and the engine request with it, instead of generating for nobody."""
    started, cancelled = asyncio.Event(), asyncio.Event()
    ctx, _ = chat_context(tok, [])

    async def forever(rid, input_ids, params):
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    ctx._generate = forever
    async with endpoint.session(ctx.chat(Trajectory())) as client_args:
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(
                http.post(
                    client_args["base_url"] + "/chat/completions",
                    json={"model": "policy", "messages": [{"role": "user", "content": "1+1="}]},
                    headers={"Authorization": f"Bearer {client_args['api_key']}"},
                )
            )
            await asyncio.wait_for(started.wait(), 10)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
        await asyncio.wait_for(cancelled.wait(), 10)
