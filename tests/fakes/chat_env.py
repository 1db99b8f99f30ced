"""A chat workflow's test environment, shared by the chat-session and OpenAI-endpoint tests:
the tiny character tokenizer with a ChatML-like template (end of turn = EOS), and a workflow
context whose engine returns scripted replies.

The `tok` fixture is used by importing it into a test module."""

from __future__ import annotations

import pytest

from asyncrl.spec import SamplingParams
from asyncrl.tiny import CHAT_TEMPLATE, build_char_tokenizer
from asyncrl.workflow import Completion, Score, WorkflowContext


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    t = build_char_tokenizer(tmp_path_factory.mktemp("tok"))
    t.chat_template = CHAT_TEMPLATE
    return t


def chat_context(tok, replies: list[list[int]], right: str = "2", chat: bool = True):
    """A context whose engine returns `replies` in turn (logprob -1, version 4); reward 1.0
    for `right`."""
    calls: list[tuple[list[int], SamplingParams]] = []
    it = iter(replies)

    async def generate(rid, input_ids, params):
        calls.append((input_ids, params))
        ids = next(it)
        text = tok.decode(ids, skip_special_tokens=True)
        reason = "stop" if ids[-1] == tok.eos_token_id else "length"
        return Completion(ids, [-1.0] * len(ids), [4] * len(ids), reason, text)

    async def score(prompt, text):
        return Score(1.0 if text == right else 0.0)

    prompt = "1+1="
    chat_prompt = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ctx = WorkflowContext(
        prompt=prompt,
        answer=right,
        prompt_ids=tok.encode(chat_prompt if chat else prompt, add_special_tokens=False),
        index=0,
        is_eval=False,
        params=SamplingParams(max_new_tokens=8),
        tokenizer=tok,
        generate=generate,
        score=score,
        version=lambda: 5,
        request_id="g:0",
        chat_prompt=chat_prompt if chat else None,
    )
    return ctx, calls


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)
