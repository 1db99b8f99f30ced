"""Workflow plugins used by the rollout tests: rollout.workflow.name =
"tests.fixtures_plugins.workflows:<Class>"."""

from __future__ import annotations

from asyncrl.workflow import AgentWorkflow, SingleTurn, Trajectory, Workflow, WorkflowContext


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


class AskTwice(AgentWorkflow):
    """Agent code on the official OpenAI SDK: answer, get asked "sure?", answer again; the
    second answer is scored."""

    def __init__(self, max_tokens: int = 4):
        self.max_tokens = int(max_tokens)

    async def agent(self, prompt: str, base_url: str, api_key: str) -> str:
        import openai

        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as llm:
            messages = [{"role": "user", "content": prompt}]
            for follow_up in ("sure?", None):
                r = await llm.chat.completions.create(
                    model="policy", messages=messages, max_tokens=self.max_tokens
                )
                answer = r.choices[0].message.content
                if follow_up:
                    messages += [
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": follow_up},
                    ]
        return answer


class PerSample(SingleTurn):
    """The built-in single turn under a plugin name, run once per sample, each with its own
    context (`Workflow.run_group`), where `single_turn` is one engine call per group."""

    run_group = Workflow.run_group
