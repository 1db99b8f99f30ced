"""asyncrl.workflow.ChatSession: a conversation becomes one trajectory in token space, exactly,
with the tiny character tokenizer and a ChatML-like template (end of turn = EOS)."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.workflow import ChatContextError, MultiTurn, Trajectory
from tests.fakes import chat_env
from tests.fakes.chat_env import chat_context, enc

tok = chat_env.tok  # the tiny character tokenizer with a chat template (a fixture)


async def test_chat_two_turns_eos_not_doubled_markup_is_env(tok):
    eos = tok.eos_token_id
    ctx, calls = chat_context(tok, [enc(tok, "3") + [eos], enc(tok, "2")])
    assert ctx.chat_prompt == "u:1+1=<eos>a:"
    traj = Trajectory()
    chat = ctx.chat(traj)
    first = await chat.send([{"role": "user", "content": "1+1="}])
    assert first.text == "3"
    convo = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "sure?"},
    ]
    await chat.send(convo, max_new_tokens=2)
    env = enc(tok, "u:sure?<eos>a:")  # the EOS that closed the reply is the policy's
    assert traj.output_ids == enc(tok, "3") + [eos] + env + enc(tok, "2")
    assert traj.loss_mask == [1, 1] + [0] * len(env) + [1]
    assert traj.logprobs == [-1.0, -1.0] + [0.0] * len(env) + [-1.0]
    assert traj.versions == [4, 4] + [5] * len(env) + [4]
    assert calls[1][0] == ctx.prompt_ids + traj.output_ids[:-1]  # the context of turn 2
    assert calls[1][1].max_new_tokens == 2 and calls[0][1].max_new_tokens == 8
    assert tok.decode(ctx.prompt_ids + traj.output_ids) == tok.apply_chat_template(
        [*convo, {"role": "assistant", "content": "2"}], tokenize=False
    ).removesuffix("<eos>")


async def test_chat_reply_cut_by_length_template_closes_the_turn_as_env(tok):
    ctx, _ = chat_context(tok, [enc(tok, "33"), enc(tok, "2")])
    traj = Trajectory()
    chat = ctx.chat(traj)
    await chat.send([{"role": "user", "content": "1+1="}])
    await chat.send(
        [
            {"role": "user", "content": "1+1="},
            {"role": "assistant", "content": "33"},
            {"role": "user", "content": "no"},
        ]
    )
    env = enc(tok, "<eos>u:no<eos>a:")
    assert traj.output_ids == enc(tok, "33") + env + enc(tok, "2")
    assert traj.loss_mask == [1, 1] + [0] * len(env) + [1]


async def test_chat_history_rewritten_is_chat_context_error_naming_messages(tok):
    ctx, _ = chat_context(tok, [enc(tok, "3"), enc(tok, "2")])
    chat = ctx.chat(Trajectory())
    await chat.send([{"role": "user", "content": "1+1="}])
    with pytest.raises(ChatContextError, match="messages: .*character 13"):
        await chat.send(
            [
                {"role": "user", "content": "1+1="},
                {"role": "assistant", "content": "4"},  # the policy said 3
                {"role": "user", "content": "no"},
            ]
        )


async def test_chat_without_chat_template_is_value_error(tok):
    ctx, _ = chat_context(tok, [], chat=False)
    with pytest.raises(ValueError, match="chat_template"):
        ctx.chat(Trajectory())


async def test_multi_turn_chat_feedback_is_a_user_turn(tok):
    eos = tok.eos_token_id
    ctx, _ = chat_context(tok, [enc(tok, "3") + [eos], enc(tok, "2") + [eos]])
    traj = await MultiTurn(max_turns=2, feedback=" no. ").run(ctx)
    env = enc(tok, "u:no.<eos>a:")
    assert traj.output_ids == enc(tok, "3") + [eos] + env + enc(tok, "2") + [eos]
    assert traj.loss_mask == [1, 1] + [0] * len(env) + [1, 1]
    assert traj.reward == 0.5 and traj.text == "2" and traj.turns == 2


async def test_chat_special_tokens_inside_a_reply_stay_in_tokens_not_in_text(tok):
    pad, eos = tok.pad_token_id, tok.eos_token_id
    ctx, _ = chat_context(tok, [enc(tok, "3") + [pad] + enc(tok, "4") + [eos], enc(tok, "2")])
    traj = Trajectory()
    chat = ctx.chat(traj)
    first = await chat.send([{"role": "user", "content": "1+1="}])
    assert first.text == "34"
    await chat.send(
        [
            {"role": "user", "content": "1+1="},
            {"role": "assistant", "content": "34"},
            {"role": "user", "content": "no"},
        ]
    )
    env = enc(tok, "u:no<eos>a:")
    assert traj.output_ids == enc(tok, "3") + [pad] + enc(tok, "4") + [eos] + env + enc(tok, "2")


async def test_chat_concurrent_send_on_one_trajectory_is_refused(tok):
    release = asyncio.Event()
    ctx, _ = chat_context(tok, [enc(tok, "3")])
    inner = ctx._generate

    async def slow(rid, input_ids, params):
        await release.wait()
        return await inner(rid, input_ids, params)

    ctx._generate = slow
    chat = ctx.chat(Trajectory())
    first = asyncio.create_task(chat.send([{"role": "user", "content": "1+1="}]))
    await asyncio.sleep(0)
    with pytest.raises(ChatContextError, match="being generated"):
        await chat.send([{"role": "user", "content": "1+1="}])
    release.set()
    assert (await first).text == "3"
