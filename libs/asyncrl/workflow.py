"""Rollout workflows: how *one* trajectory is produced from one prompt.

The system does the grouping. For every group the scheduler dispatches, the rollout service
gives the experiment's workflow one `WorkflowContext` per sample and calls `run_group`, which
by default runs `run` once per context, concurrently; it then scores the trajectories that
asked to be scored, applies the dynamic filter and publishes the group. A workflow therefore
never deals with versions, retries or transport: `run` calls `ctx.generate(...)`
(interruptible, per-token versions kept), optionally `ctx.score(text)` (the experiment's reward
function, on the reward services), appends environment tokens with `Trajectory.add_env`, and
returns one `Trajectory` (an `asyncrl.types.Sample`). A workflow whose samples can be made
together overrides `run_group` (`SingleTurn`: the n completions in one engine call,
`generate_all`).

A trajectory's tokens after the group's prompt are `output_ids`; `loss_mask` marks which of
them the policy produced (1, trained) and which the environment inserted (0: feedback, tool
results; they condition later turns but carry no gradient).

Chat: with `rollout.workflow.chat_template: true` the group's prompt is the dataset prompt as
a user turn under the tokenizer's chat template, and `ctx.chat(traj)` is a `ChatSession`: send
it the whole conversation (OpenAI-style messages) and it appends to the trajectory the tokens
the template added since the last turn (environment tokens) and the policy's reply.

Built in: `single_turn` (one completion, scored by the reward function) and `multi_turn`
(answer, get feedback, retry). Plugins: `rollout.workflow.name: "my_pkg.agents:Solver"`, a
`Workflow` subclass importable by the rollout service; `rollout.workflow.args` go to its
constructor.
"""

from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from asyncrl.registry import WORKFLOWS, import_object, is_plugin_name
from asyncrl.spec import SamplingParams
from asyncrl.types import Completion, RewardStatus, Sample, Score

Trajectory = Sample
"""What a workflow builds and returns: one `asyncrl.types.Sample` (the same object is scored,
published and trained on)."""

GenerateFn = Callable[[str, list[int], SamplingParams], Awaitable[Completion]]
"""(request id, input ids, sampling params) -> the completion."""
GenerateManyFn = Callable[
    [list[tuple[str, list[int], SamplingParams]]], Awaitable[list[Completion]]
]
"""The same for several requests in one engine call, completions in their order."""

T = TypeVar("T")


async def run_together(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run `coros` concurrently and return their results in order; the first failure cancels
    the others and is raised (itself, not an ExceptionGroup)."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except ExceptionGroup as eg:
        raise eg.exceptions[0] from eg
    return [t.result() for t in tasks]


class WorkflowContext:
    """What a workflow run may use. The service builds one per sample."""

    def __init__(
        self,
        *,
        prompt: str,
        answer: str,
        prompt_ids: list[int],
        index: int,
        is_eval: bool,
        params: SamplingParams,
        tokenizer,
        generate: GenerateFn,
        score: Callable[[str, str], Awaitable[Score]],
        version: Callable[[], int],
        request_id: str,
        chat_prompt: str | None = None,
        openai_session: Callable[[ChatSession], AbstractAsyncContextManager[dict[str, str]]]
        | None = None,
        generate_many: GenerateManyFn | None = None,
    ):
        self.prompt, self.answer, self.prompt_ids = prompt, answer, list(prompt_ids)
        self.index, self.is_eval, self.params, self.tokenizer = index, is_eval, params, tokenizer
        self._generate, self._score, self._version = generate, score, version
        self._rid, self._calls = request_id, 0
        self.chat_prompt = chat_prompt
        """The text `prompt_ids` encode when the prompt is chat-templated, else None."""
        self._openai_session = openai_session
        self._generate_many = generate_many
        """The group's engine call for several requests at once (`generate_all`), if any."""

    @property
    def version(self) -> int:
        """The policy version the engine serves now."""
        return self._version()

    @property
    def request_id(self) -> str:
        """`<group id>:<sample index>`: which dispatch of which prompt this sample belongs to
        (a training group id ends `-a<attempt>`: a prompt sampled again after a drop)."""
        return self._rid

    async def generate(self, input_ids: list[int], **overrides: Any) -> Completion:
        """Sample one completion of `input_ids` with the experiment's sampling settings
        (`overrides`, e.g. max_new_tokens=16, replace single fields). Each call has a stable
        request id `<group>:<sample>` (`:t<k>` from the second call on)."""
        return await self._generate(*self._request(input_ids, overrides))

    def _request(
        self, input_ids: list[int], overrides: dict[str, Any]
    ) -> tuple[str, list[int], SamplingParams]:
        """The next call's request id, input and sampling settings."""
        params = self.params.model_copy(update=overrides) if overrides else self.params
        rid = self._rid if self._calls == 0 else f"{self._rid}:t{self._calls}"
        self._calls += 1
        return rid, list(input_ids), params

    async def score(self, text: str) -> Score:
        """The experiment's reward function on `text` against this prompt's answer."""
        return await self._score(self.prompt, text)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The conversation under the tokenizer's chat template, ready for the assistant."""
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )

    def chat(self, traj: Trajectory) -> ChatSession:
        """A chat session that builds `traj` (needs `rollout.workflow.chat_template: true`)."""
        return ChatSession(self, traj)

    def openai(self, traj: Trajectory) -> AbstractAsyncContextManager[dict[str, str]]:
        """`async with ctx.openai(traj) as client:` an OpenAI-compatible endpoint bound to a chat
        session on `traj`; `client` holds `base_url` and `api_key` for `openai.AsyncOpenAI(**client)`
        or any HTTP client. Needs `rollout.workflow.chat_template: true`."""
        if self._openai_session is None:
            raise RuntimeError("no OpenAI-compatible endpoint in this rollout service")
        return self._openai_session(self.chat(traj))


class ChatContextError(ValueError):
    """A conversation that does not extend what the trajectory already holds."""


class ChatSession:
    """Multi-turn chat on one trajectory, in token space.

    Each `send(messages)` renders the whole conversation with the chat template. What the
    trajectory holds so far (prompt, replies, earlier environment text) must be a prefix of
    that rendering: the rest (the template's end-of-turn markup, tool results, the next user
    turn) is appended as environment tokens, then the policy samples the reply. The policy's own
    tokens are kept as sampled, never re-tokenized, so their behaviour logprobs stay valid; a
    reply that ended with a special token (EOS) that the template also writes after the message
    (ChatML's `<|im_end|>`) is not added twice. A conversation that rewrites history (an edited
    or dropped earlier message, another system prompt) is a `ChatContextError`: it cannot be
    one trajectory."""

    def __init__(self, ctx: WorkflowContext, traj: Trajectory):
        if ctx.chat_prompt is None:
            raise ValueError("chat: set rollout.workflow.chat_template: true")
        self.ctx, self.traj = ctx, traj
        self.text = ctx.chat_prompt + ctx.tokenizer.decode(traj.output_ids)
        """What the template renders for the trajectory so far (replies without special
        tokens)."""
        self._tail = ""  # special tokens that ended the last reply (already in the trajectory)
        self._busy = False

    async def send(self, messages: list[dict[str, Any]], **overrides: Any) -> Completion:
        """Sample the assistant's reply to `messages` (the whole conversation so far)."""
        if self._busy:  # a trajectory is one line of turns
            raise ChatContextError("messages: a reply for this trajectory is being generated")
        self._busy = True
        try:
            return await self._send(messages, overrides)
        finally:
            self._busy = False

    async def _send(self, messages: list[dict[str, Any]], overrides: dict[str, Any]) -> Completion:
        rendered = self.ctx.render_chat(messages)
        if not rendered.startswith(self.text):
            at = len(os.path.commonprefix([rendered, self.text]))
            raise ChatContextError(
                "messages: the conversation does not extend this trajectory (first difference"
                f" at character {at}: {rendered[at : at + 40]!r} vs {self.text[at : at + 40]!r})"
            )
        added = rendered[len(self.text) :]
        if self._tail and added.startswith(self._tail):
            added = added[len(self._tail) :]
        if added:
            ids = self.ctx.tokenizer.encode(added, add_special_tokens=False)
            self.traj.add_env(ids, self.ctx.version)
        reply = await self.ctx.generate(self.ctx.prompt_ids + self.traj.output_ids, **overrides)
        self.traj.add_policy(reply)
        # the client sees (and sends back) the reply without special tokens; the trajectory
        # keeps them as sampled. A trailing run (EOS) may be what the template writes next.
        tok, ids = self.ctx.tokenizer, reply.output_ids
        special, end = set(tok.all_special_ids), len(ids)
        while end and ids[end - 1] in special:
            end -= 1
        self.text = rendered + tok.decode(ids, skip_special_tokens=True)
        self._tail = tok.decode(ids[end:])
        return reply


async def generate_all(ctxs: list[WorkflowContext], **overrides: Any) -> list[Completion]:
    """One completion of each context's prompt, as `ctx.generate(ctx.prompt_ids, **overrides)`
    gives it (same request ids), made together: one engine call where the service offers it,
    else concurrently (the first failure cancels the others)."""
    requests = [ctx._request(ctx.prompt_ids, overrides) for ctx in ctxs]
    generate_many = ctxs[0]._generate_many if ctxs else None
    if generate_many is not None:
        return await generate_many(requests)
    return await run_together(
        [ctx._generate(*req) for ctx, req in zip(ctxs, requests, strict=True)]
    )


class Workflow(ABC):
    """Subclass and implement `run`; constructor keyword arguments come from
    `rollout.workflow.args`. One instance serves every sample of a group."""

    def __init__(self, **args: Any):
        if args:
            raise TypeError(f"{type(self).__name__} takes no arguments, got {sorted(args)}")

    @abstractmethod
    async def run(self, ctx: WorkflowContext) -> Trajectory: ...

    async def run_group(self, ctxs: list[WorkflowContext]) -> list[Trajectory]:
        """The group's trajectories, one per context, in order: `run` for each, concurrently;
        the first failure cancels the others and is raised. Override to make them together."""
        return await run_together([self.run(ctx) for ctx in ctxs])


class SingleTurn(Workflow):
    """One completion of the prompt, scored by the experiment's reward function. A group's n
    completions are one engine call (`run_group`)."""

    async def run(self, ctx: WorkflowContext) -> Trajectory:
        return self._trajectory(await ctx.generate(ctx.prompt_ids))

    async def run_group(self, ctxs: list[WorkflowContext]) -> list[Trajectory]:
        return [self._trajectory(c) for c in await generate_all(ctxs)]

    @staticmethod
    def _trajectory(completion: Completion) -> Trajectory:
        traj = Trajectory(text=completion.text)  # all of it is the policy's: what is scored
        traj.add_policy(completion)
        return traj


class MultiTurn(Workflow):
    """Answer; if the reward function says wrong, the environment replies `feedback` (a user
    turn when the prompt is chat-templated) and the policy tries again, up to `max_turns`
    answers. The reward is `turn_discount ** k` for a correct answer at turn k (0-based), 0 if
    none is. The feedback tokens are not trained."""

    def __init__(self, max_turns: int = 2, feedback: str = " no. ", turn_discount: float = 0.5):
        if int(max_turns) < 1:
            raise ValueError(f"max_turns: must be >= 1, got {max_turns}")
        if not 0.0 < float(turn_discount) <= 1.0:
            raise ValueError(f"turn_discount: must be in (0, 1], got {turn_discount}")
        self.max_turns, self.feedback = int(max_turns), str(feedback)
        self.turn_discount = float(turn_discount)

    async def run(self, ctx: WorkflowContext) -> Trajectory:
        traj = Trajectory(reward=0.0)
        feedback_ids = ctx.encode(self.feedback)
        chat = ctx.chat(traj) if ctx.chat_prompt is not None else None
        messages = [{"role": "user", "content": ctx.prompt}]
        for turn in range(self.max_turns):
            if chat is not None:  # feedback is the next user turn
                c = await chat.send(messages)
                messages += [
                    {"role": "assistant", "content": c.text},
                    {"role": "user", "content": self.feedback.strip()},
                ]
            else:
                c = await ctx.generate(ctx.prompt_ids + traj.output_ids)
                traj.add_policy(c)
            answer = ctx.decode(c.output_ids)
            score = await ctx.score(answer)
            traj.text = answer
            if score.status is not RewardStatus.OK:
                traj.reward, traj.reward_status, traj.reward_reason = (
                    0.0,
                    score.status,
                    score.reason,
                )
                return traj
            if score.reward > 0:
                traj.reward = score.reward * self.turn_discount**turn
                return traj
            if turn + 1 < self.max_turns and chat is None:
                traj.add_env(feedback_ids, ctx.version)
        return traj


class AgentWorkflow(Workflow):
    """Agent code written against the OpenAI chat API, as a workflow: implement `agent`, which
    talks to `base_url` with `api_key` (e.g. `openai.AsyncOpenAI(base_url=..., api_key=...)`) as
    many turns as it likes and returns its final answer; every reply is sampled from the policy
    into one trajectory, and the answer is scored with the experiment's reward function.
    Needs `rollout.workflow.chat_template: true`."""

    async def run(self, ctx: WorkflowContext) -> Trajectory:
        traj = Trajectory()
        async with ctx.openai(traj) as client:
            traj.text = await self.agent(ctx.prompt, client["base_url"], client["api_key"])
        return traj

    @abstractmethod
    async def agent(self, prompt: str, base_url: str, api_key: str) -> str:
        """Solve `prompt` through the endpoint; return the answer to score."""


def resolve_workflow(name: str) -> type[Workflow]:
    """A built-in name (`asyncrl.registry.WORKFLOWS`) or `module.path:Class`; ValueError saying
    what is wrong otherwise."""
    _check_name(name)
    try:
        cls = WORKFLOWS.load(name) if name in WORKFLOWS.names else import_object(name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"workflow {name!r} cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Workflow)):
        raise ValueError(f"workflow {name!r} is not a subclass of asyncrl.workflow.Workflow")
    return cls


def check_workflow(name: str, args: dict[str, Any]) -> None:
    """Check a workflow without importing user code: a built-in is constructed with `args`; a
    plugin is checked by name only (`module.path:Class`), the rollout loads it when the
    experiment binds there. ValueError saying what is wrong."""
    _check_name(name)
    if name in WORKFLOWS.names:
        make_workflow(name, args)


def _check_name(name: str) -> None:
    if name not in WORKFLOWS.names and not is_plugin_name(name):
        raise ValueError(
            f"unknown workflow {name!r}: use one of {sorted(WORKFLOWS.names)} or"
            " 'module.path:Class'"
        )


def make_workflow(name: str, args: dict[str, Any]) -> Workflow:
    """Resolve and construct; a bad argument is a ValueError naming the workflow."""
    cls = resolve_workflow(name)
    try:
        return cls(**args)
    except (TypeError, ValueError) as e:
        raise ValueError(f"workflow {name!r} rejects its args {args}: {e}") from None
