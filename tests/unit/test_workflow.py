"""asyncrl.workflow: trajectories, the built-in workflows against a scripted context, plugin
resolution, and the spec/wire form of `rollout.workflow`."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.convert import sample_from_proto, sample_to_proto
from asyncrl.spec import ExperimentSpec, SamplingParams, spec_from_json, spec_to_json
from asyncrl.types import RewardStatus, Sample
from asyncrl.workflow import (
    Completion,
    MultiTurn,
    Score,
    SingleTurn,
    Trajectory,
    Workflow,
    WorkflowContext,
    generate_all,
    make_workflow,
    resolve_workflow,
)


class CharTok:
    """One token per character (ord), enough for the workflows' encode/decode."""

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": [ord(c) for c in text]})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _completion(text: str, version: int) -> Completion:
    ids = [ord(c) for c in text]
    return Completion(
        output_ids=ids,
        logprobs=[-1.0] * len(ids),
        versions=[version] * len(ids),
        finish_reason="stop",
        text=text,
    )


def scripted_context(
    answers: list[str],
    right: str = "7",
    fail_on: str = "",
    version=3,
    index: int = 0,
    generate_many=None,
):
    """A context whose engine returns `answers` in turn (version `version`, logprob -1 per
    token) and whose reward is 1.0 for `right`, FAILED for `fail_on`, 0 otherwise."""
    calls: list[tuple[str, list[int], SamplingParams]] = []
    scored: list[str] = []
    it = iter(answers)

    async def generate(rid, input_ids, params):
        calls.append((rid, input_ids, params))
        return _completion(next(it), version)

    async def score(prompt, text):
        scored.append(text)
        if text == fail_on:
            return Score(0.0, RewardStatus.FAILED, "timeout")
        return Score(1.0 if text == right else 0.0)

    ctx = WorkflowContext(
        prompt="q",
        answer=right,
        prompt_ids=[ord("q")],
        index=index,
        is_eval=False,
        params=SamplingParams(max_new_tokens=8),
        tokenizer=CharTok(),
        generate=generate,
        score=score,
        version=lambda: version,
        request_id=f"g:{index}",
        generate_many=generate_many,
    )
    return ctx, calls, scored


async def test_single_turn_run_group_is_one_engine_call_with_each_samples_request_id():
    batches = []

    async def generate_many(requests):
        batches.append(requests)
        return [_completion(f"a{i}", 5) for i in range(len(requests))]

    ctxs = [scripted_context([], index=i, generate_many=generate_many)[0] for i in range(3)]
    trajs = await SingleTurn().run_group(ctxs)
    [batch] = batches
    assert [(rid, ids) for rid, ids, _ in batch] == [("g:0", [113]), ("g:1", [113]), ("g:2", [113])]
    assert [t.output_ids for t in trajs] == [[97, 48], [97, 49], [97, 50]]
    assert [(t.text, t.loss_mask, t.versions, t.turns) for t in trajs] == [
        (f"a{i}", [1, 1], [5, 5], 1) for i in range(3)
    ]
    assert [t.reward for t in trajs] == [None] * 3  # left for the rollout to score


async def test_generate_all_without_group_call_generates_each_context_in_order():
    made = [scripted_context([f"x{i}"], index=i) for i in range(3)]
    got = await generate_all([ctx for ctx, _, _ in made], max_new_tokens=2)
    assert [c.text for c in got] == ["x0", "x1", "x2"]
    assert [calls[0][0] for _, calls, _ in made] == ["g:0", "g:1", "g:2"]
    assert all(calls[0][2].max_new_tokens == 2 for _, calls, _ in made)


class FailsAt(Workflow):
    """Sample 1 raises; the others wait until cancelled."""

    def __init__(self):
        self.cancelled = 0

    async def run(self, ctx):
        if ctx.index == 1:
            await asyncio.sleep(0)  # the others are running by then
            raise RuntimeError("sample 1 failed")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


async def test_workflow_run_group_default_runs_each_first_failure_cancels_others():
    ctxs = [scripted_context(["ab", "cd"], index=i)[0] for i in range(2)]
    trajs = await MultiTurn(max_turns=1).run_group(ctxs)
    assert [t.output_ids for t in trajs] == [[97, 98], [97, 98]]
    flow = FailsAt()
    ctxs = [scripted_context([], index=i)[0] for i in range(3)]
    with pytest.raises(RuntimeError, match="sample 1 failed"):
        await flow.run_group(ctxs)
    assert flow.cancelled == 2


async def test_single_turn_is_one_call_unscored_all_policy_tokens():
    ctx, calls, scored = scripted_context(["ab"])
    t = await SingleTurn().run(ctx)
    assert (t.output_ids, t.loss_mask, t.reward, t.turns) == ([97, 98], [1, 1], None, 1)
    assert [c[0] for c in calls] == ["g:0"] and scored == []


async def test_multi_turn_wrong_then_right_discounted_feedback_masked_request_ids():
    ctx, calls, scored = scripted_context(["5", "7"])
    t = await MultiTurn(max_turns=3, feedback="no", turn_discount=0.5).run(ctx)
    assert t.output_ids == [ord("5"), ord("n"), ord("o"), ord("7")]
    assert t.loss_mask == [1, 0, 0, 1]
    assert t.logprobs == [-1.0, 0.0, 0.0, -1.0] and t.versions == [3, 3, 3, 3]
    assert (t.reward, t.reward_status, t.text, t.turns) == (0.5, RewardStatus.OK, "7", 2)
    assert scored == ["5", "7"]
    assert [c[0] for c in calls] == ["g:0", "g:0:t1"]
    assert calls[1][1] == [ord("q"), ord("5"), ord("n"), ord("o")]  # the whole context


async def test_multi_turn_right_first_is_full_reward_never_right_is_zero():
    ctx, _, _ = scripted_context(["7"])
    t = await MultiTurn(max_turns=2).run(ctx)
    assert (t.reward, t.loss_mask, t.turns) == (1.0, [1], 1)
    ctx, _, scored = scripted_context(["1", "2"])
    t = await MultiTurn(max_turns=2, feedback="x").run(ctx)
    assert (t.reward, t.loss_mask, scored) == (0.0, [1, 0, 1], ["1", "2"])  # no feedback last


async def test_multi_turn_failed_score_is_failed_sample_not_zero():
    ctx, _, _ = scripted_context(["9"], fail_on="9")
    t = await MultiTurn(max_turns=3).run(ctx)
    assert (t.reward_status, t.reward_reason, t.turns) == (RewardStatus.FAILED, "timeout", 1)


async def test_context_generate_overrides_one_field_keeps_the_rest():
    ctx, calls, _ = scripted_context(["a"])
    await ctx.generate([1, 2], max_new_tokens=2)
    assert calls[0][2].max_new_tokens == 2 and ctx.params.max_new_tokens == 8


def test_trajectory_add_env_keeps_lists_aligned():
    t = Trajectory()
    t.add_policy(Completion([1, 2], [-0.5, -0.5], [0, 1], "length"))
    t.add_env([7], version=1)
    assert (t.output_ids, t.logprobs, t.versions, t.loss_mask) == (
        [1, 2, 7],
        [-0.5, -0.5, 0.0],
        [0, 1, 1],
        [1, 1, 0],
    )
    assert (t.finish_reason, t.all_policy) == ("length", False)


def test_resolve_builtin_plugin_and_errors():
    assert resolve_workflow("multi_turn") is MultiTurn
    cls = resolve_workflow("tests.fixtures_plugins.workflows:TwoCalls")
    assert cls.__name__ == "TwoCalls"
    with pytest.raises(ValueError, match="unknown workflow 'nope'"):
        resolve_workflow("nope")
    with pytest.raises(ValueError, match="cannot be loaded"):
        resolve_workflow("tests.fixtures_plugins.workflows:Missing")
    with pytest.raises(ValueError, match="not a subclass"):
        resolve_workflow("asyncrl.workflow:Completion")
    with pytest.raises(ValueError, match="max_turns"):
        make_workflow("multi_turn", {"max_turns": 0})
    with pytest.raises(ValueError, match="takes no arguments"):
        make_workflow("single_turn", {"x": 1})


def test_spec_workflow_round_trips_the_wire_with_integer_args():
    spec = ExperimentSpec(
        model={"path": "m"},
        dataset={"path": "d"},
        rollout={"workflow": {"name": "multi_turn", "args": {"max_turns": 3, "feedback": "no"}}},
    )
    back = spec_from_json(spec_to_json(spec)).rollout.workflow
    assert (back.name, back.args) == ("multi_turn", {"max_turns": 3, "feedback": "no"})
    assert isinstance(back.args["max_turns"], int)  # JSON keeps integers integers
    default = spec_from_json(
        spec_to_json(ExperimentSpec(model={"path": "m"}, dataset={"path": "d"}))
    )
    assert default.rollout.workflow.name == "single_turn"


def test_sample_loss_mask_wire_form_empty_when_all_policy():
    mixed = Sample([1, 2, 3], [-1.0, 0.0, -1.0], [0, 0, 0], loss_mask=[1, 0, 1])
    assert sample_from_proto(sample_to_proto(mixed)).loss_mask == [1, 0, 1]
    plain = Sample([1], [-1.0], [0], loss_mask=[1])
    assert sample_to_proto(plain).loss_mask == []
    assert sample_from_proto(sample_to_proto(plain)).trained_mask() == [1]
