"""Rollout workflows: how *one* trajectory is produced from one prompt.

The system does the grouping. For every group the scheduler dispatches, the rollout service
runs the experiment's workflow `n_samples` times concurrently (each run gets its own
`WorkflowContext`), scores the trajectories that asked to be scored, applies the dynamic filter
and publishes the group. A workflow therefore never deals with groups, versions, retries or
transport: it calls `ctx.generate(...)` (interruptible, per-token versions kept), optionally
`ctx.score(text)` (the experiment's reward function, on the reward services), appends
environment tokens with `Trajectory.add_env`, and returns one `Trajectory`.

A trajectory's tokens after the group's prompt are `output_ids`; `loss_mask` marks which of
them the policy produced (1, trained) and which the environment inserted (0: feedback, tool
results; they condition later turns but carry no gradient).

Built in: `single_turn` (one completion, scored by the reward function) and `multi_turn`
(answer, get feedback, retry). Plugins: `rollout.workflow.name: "my_pkg.agents:Solver"`, a
`Workflow` subclass importable by the rollout service; `rollout.workflow.args` go to its
constructor.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.spec import SamplingParams
from asyncrl.types import RewardStatus


@dataclass
class Completion:
    """What one `ctx.generate` call returns: the policy's tokens with their behaviour logprobs
    and the version that produced each (a weight update mid-way shows as two versions)."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str = ""


@dataclass
class Score:
    reward: float
    status: RewardStatus = RewardStatus.OK
    reason: str = ""


@dataclass
class Trajectory:
    """One sample of a group, built turn by turn. Per-token lists stay aligned.

    `reward=None` asks the service to score `text` (or, if empty, the decoded policy tokens)
    with the experiment's reward function; a workflow that scored itself sets reward and,
    on failure, `reward_status=FAILED` with a reason."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    reward: float | None = None
    reward_status: RewardStatus = RewardStatus.OK
    reward_reason: str = ""
    text: str = ""
    turns: int = 0

    def add_policy(self, c: Completion) -> None:
        """Append a completion: trained tokens."""
        self.output_ids += c.output_ids
        self.logprobs += c.logprobs
        self.versions += c.versions
        self.loss_mask += [1] * len(c.output_ids)
        self.finish_reason = c.finish_reason
        self.turns += 1

    def add_env(self, token_ids: list[int], version: int) -> None:
        """Append environment tokens (feedback, tool output): context for the next turn, no
        loss. They carry the version serving when they were appended and logprob 0."""
        self.output_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [version] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)

    @property
    def all_policy(self) -> bool:
        return all(self.loss_mask)


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
        generate: Callable[[str, list[int], SamplingParams], Awaitable[Completion]],
        score: Callable[[str, str], Awaitable[Score]],
        version: Callable[[], int],
        request_id: str,
    ):
        self.prompt, self.answer, self.prompt_ids = prompt, answer, list(prompt_ids)
        self.index, self.is_eval, self.params, self.tokenizer = index, is_eval, params, tokenizer
        self._generate, self._score, self._version = generate, score, version
        self._rid, self._calls = request_id, 0

    @property
    def version(self) -> int:
        """The policy version the engine serves now."""
        return self._version()

    async def generate(self, input_ids: list[int], **overrides: Any) -> Completion:
        """Sample one completion of `input_ids` with the experiment's sampling settings
        (`overrides`, e.g. max_new_tokens=16, replace single fields). Each call has a stable
        request id `<group>:<sample>` (`:t<k>` from the second call on)."""
        params = self.params.model_copy(update=overrides) if overrides else self.params
        rid = self._rid if self._calls == 0 else f"{self._rid}:t{self._calls}"
        self._calls += 1
        return await self._generate(rid, list(input_ids), params)

    async def score(self, text: str) -> Score:
        """The experiment's reward function on `text` against this prompt's answer."""
        return await self._score(self.prompt, text)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


class Workflow(ABC):
    """Subclass and implement `run`; constructor keyword arguments come from
    `rollout.workflow.args`. One instance serves every sample of a group."""

    def __init__(self, **args: Any):
        if args:
            raise TypeError(f"{type(self).__name__} takes no arguments, got {sorted(args)}")

    @abstractmethod
    async def run(self, ctx: WorkflowContext) -> Trajectory: ...


class SingleTurn(Workflow):
    """One completion of the prompt, scored by the experiment's reward function."""

    async def run(self, ctx: WorkflowContext) -> Trajectory:
        traj = Trajectory()
        traj.add_policy(await ctx.generate(ctx.prompt_ids))
        return traj


class MultiTurn(Workflow):
    """Answer; if the reward function says wrong, the environment replies `feedback` and the
    policy tries again, up to `max_turns` answers. The reward is `turn_discount ** k` for a
    correct answer at turn k (0-based), 0 if none is. The feedback tokens are not trained."""

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
        for turn in range(self.max_turns):
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
            if turn + 1 < self.max_turns:
                traj.add_env(feedback_ids, ctx.version)
        return traj


BUILTIN: dict[str, type[Workflow]] = {"single_turn": SingleTurn, "multi_turn": MultiTurn}


def resolve_workflow(name: str) -> type[Workflow]:
    """A built-in name or `module:Class`; ValueError saying what is wrong otherwise."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ValueError(
            f"unknown workflow {name!r}: use one of {sorted(BUILTIN)} or 'module:Class'"
        )
    module_name, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"workflow {name!r} cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Workflow)):
        raise ValueError(f"workflow {name!r} is not a subclass of asyncrl.workflow.Workflow")
    return cls


def make_workflow(name: str, args: dict[str, Any]) -> Workflow:
    """Resolve and construct; a bad argument is a ValueError naming the workflow."""
    cls = resolve_workflow(name)
    try:
        return cls(**args)
    except (TypeError, ValueError) as e:
        raise ValueError(f"workflow {name!r} rejects its args {args}: {e}") from None
