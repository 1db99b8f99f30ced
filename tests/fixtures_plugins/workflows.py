"""Workflow plugins used by the rollout tests: rollout.workflow.name =
"tests.fixtures_plugins.workflows:<Class>"."""

from __future__ import annotations

from asyncrl.workflow import Trajectory, Workflow, WorkflowContext


class TwoCalls(Workflow):
    """Two completions of fixed lengths with an environment `marker` between them; rewards
    itself with the sample's index (so a group is never constant)."""

    def __init__(self, marker: str = "|", first: int = 3, second: int = 2):
        self.marker, self.first, self.second = marker, int(first), int(second)

    async def run(self, ctx: WorkflowContext) -> Trajectory:
        t = Trajectory()
        t.add_policy(await ctx.generate(ctx.prompt_ids, max_new_tokens=self.first))
        t.add_env(ctx.encode(self.marker), ctx.version)
        t.add_policy(await ctx.generate(ctx.prompt_ids + t.output_ids, max_new_tokens=self.second))
        t.reward = float(ctx.index)
        return t


class Broken(Workflow):
    async def run(self, ctx: WorkflowContext) -> Trajectory:
        raise RuntimeError("scripted workflow failure")
