"""A long-tail workflow for the system benchmark (a plugin, not a product feature).

Each sample gets a target output length drawn from a lognormal (median, sigma, capped at
`max_len`) and generates until it has that many tokens, whatever the policy samples: a
generation-dominated workload with a heavy tail, like long reasoning rollouts.

    rollout.workflow: {name: "bench.longtail:LongTail", args: {median: 32, sigma: 1.5, max_len: 1024}}

The target is a pure function of (seed, prompt, attempt, sample index), so every run of the
benchmark, at any eta, generates the same lengths for the same dispatch of a prompt, and the
benchmark can hand the very same lengths to its model of the ideal (`target_lengths`). The
attempt comes from the group id (`...-a<k>`, `WorkflowContext.request_id`): a prompt dropped
as too stale is sampled again, as a policy would, with new lengths; with the first attempt's
lengths again, a straggler that cannot finish within eta steps would be dropped again and again.

Ignoring EOS: the engine contract has no `ignore_eos` flag for the torch engine (the service
always adds the tokenizer's EOS as a stop token). The benchmark therefore serves a tokenizer
without an EOS token (`spec.model.tokenizer_path`), and this workflow also continues a sample
that stopped early (the stop token stays in the trajectory as a policy token), so a target is
met with any tokenizer.
"""

from __future__ import annotations

import math
import random

from asyncrl.types import GroupId
from asyncrl.workflow import Trajectory, Workflow, WorkflowContext


def target_length(
    seed: int, prompt: str, index: int, median: float, sigma: float, cap: int, attempt: int = 0
) -> int:
    """round(median * exp(sigma * Z)) clipped to [1, cap], Z ~ N(0, 1) seeded by the arguments."""
    key = f"{seed}|{prompt}|{index}" + (f"|a{attempt}" if attempt else "")
    z = random.Random(key).gauss(0.0, 1.0)
    return int(min(max(round(median * math.exp(sigma * z)), 1), cap))


def target_lengths(
    seed: int, prompt: str, n: int, median: float, sigma: float, cap: int, attempt: int = 0
) -> list[int]:
    """The n target lengths of one dispatch (sample i of attempt `attempt` of `prompt`)."""
    return [target_length(seed, prompt, i, median, sigma, cap, attempt) for i in range(n)]


def attempt_of(request_id: str) -> int:
    """The attempt of a training group's sample `<group id>:<j>` (`asyncrl.types.GroupId`); 0
    for any other (an eval group's)."""
    gid = GroupId.parse(request_id.rpartition(":")[0])
    return gid.attempt if gid else 0


class LongTail(Workflow):
    """Generate exactly `target_length(...)` tokens; the reward function scores the text."""

    def __init__(
        self, median: float = 32.0, sigma: float = 1.5, max_len: int = 1024, seed: int = 0
    ):
        if float(median) <= 0 or float(sigma) < 0 or int(max_len) < 1:
            raise ValueError(
                f"need median > 0, sigma >= 0, max_len >= 1: {median}, {sigma}, {max_len}"
            )
        self.median, self.sigma = float(median), float(sigma)
        self.max_len, self.seed = int(max_len), int(seed)

    async def run(self, ctx: WorkflowContext) -> Trajectory:
        attempt = attempt_of(ctx.request_id)
        target = target_length(
            self.seed, ctx.prompt, ctx.index, self.median, self.sigma, self.max_len, attempt
        )
        traj = Trajectory()
        while len(traj.output_ids) < target:
            c = await ctx.generate(
                ctx.prompt_ids + traj.output_ids,
                max_new_tokens=target - len(traj.output_ids),
            )
            traj.add_policy(c)
            if c.finish_reason != "stop" or not c.output_ids:
                break  # the target (or the model's context) is reached
        return traj
