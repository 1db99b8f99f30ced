"""asyncrl.workflow: trajectories, the built-in workflows against a scripted context, plugin
resolution, and the spec/wire form of `rollout.workflow`."""

from __future__ import annotations

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
    WorkflowContext,
    make_workflow,
    resolve_workflow,
)


class CharTok:
    """One token per character (ord), enough for the workflows' encode/decode."""

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": [ord(c) for c in text]})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def scripted_context(answers: list[str], right: str = "7", fail_on: str = "", version=3):
    """A context whose engine returns `answers` in turn (version `version`, logprob -1 per
    token) and whose reward is 1.0 for `right`, FAILED for `fail_on`, 0 otherwise."""
    calls: list[tuple[str, list[int], SamplingParams]] = []
    scored: list[str] = []
    it = iter(answers)

    async def generate(rid, input_ids, params):
        calls.append((rid, input_ids, params))
        ids = [ord(c) for c in next(it)]
        return Completion(ids, [-1.0] * len(ids), [version] * len(ids), "stop")

    async def score(prompt, text):
        scored.append(text)
        if text == fail_on:
            return Score(0.0, RewardStatus.FAILED, "timeout")
        return Score(1.0 if text == right else 0.0)

    ctx = WorkflowContext(
        prompt="q",
        answer=right,
        prompt_ids=[ord("q")],
        index=0,
        is_eval=False,
        params=SamplingParams(max_new_tokens=8),
        tokenizer=CharTok(),
        generate=generate,
        score=score,
        version=lambda: version,
        request_id="g:0",
    )
    return ctx, calls, scored


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
