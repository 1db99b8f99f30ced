"""The math recipe (examples/math): the final-answer extraction and reward, the GSM8K data
prep, and its two specs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from asyncrl.cli import load_spec
from asyncrl.rewards import validate_reward_function
from examples.math.prepare import INSTRUCTION, gold, prepare, to_row
from examples.math.reward import final_answer, final_answer_of

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "math"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("So she has 7 + 8 = 15 apples.\n#### 15", 15.0),
        ("#### 1,500", 1500.0),
        ("it drops to -4 degrees #### -4", -4.0),
        ("The answer: #### 1.5 liters", 1.5),
        ("#### $1,000.50", 1000.5),
        ("first #### 3 then a correction #### 4", 4.0),  # the last marker
        ("#### nothing after it, but 12 before", 12.0),  # no number after: the last number
        ("The total is \\boxed{42}.", 42.0),
        ("\\boxed{\\frac{3}{4}}", 0.75),
        ("\\boxed{\\dfrac{-1}{2}}", -0.5),
        ("\\boxed{1{,}000}", 1000.0),
        ("\\boxed{x} but 9 apples", 9.0),  # a box without a number: the last number
        ("first \\boxed{2} then \\boxed{5}", 5.0),
        ("12 - 5 = 7 apples, then 7 + 8 = 15 apples", 15.0),
        ("no number at all", None),
        ("", None),
    ],
)
def test_final_answer_of_marker_then_boxed_then_last_number(text, value):
    assert final_answer_of(text) == value


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("7 + 8 = 15 #### 15", "15", 1.0),
        ("I think it is \\boxed{15}", "Tom has 7 + 8 = <<7+8=15>>15.\n#### 15", 1.0),
        ("so 1,500 dollars", "1500", 1.0),
        ("#### 15.0", "15", 1.0),
        ("#### 16", "15", 0.0),
        ("no idea", "15", 0.0),
        ("#### 14.99999", "15", 0.0),  # 1e-5 off: past the tolerance, 1e-6
    ],
)
def test_final_answer_reward_compares_numbers(completion, answer, reward):
    assert final_answer(completion, answer, "") == reward


def test_final_answer_tolerance_kwarg_and_numberless_gold_raises():
    assert final_answer("#### 14.99", "15", "", tolerance="0.05") == 1.0
    with pytest.raises(ValueError, match="answer has no number"):
        final_answer("#### 15", "fifteen", "")


def test_final_answer_is_a_valid_reward_plugin():
    validate_reward_function("plugin:examples.math.reward:final_answer", {"tolerance": "0.01"})


def test_gold_takes_the_number_after_the_marker_without_separators():
    assert gold("He saves 125 * 12 = <<125*12=1500>>1,500.\n#### 1,500") == "1500"
    assert gold("#### -4") == "-4"
    assert gold("#### 2.5\n") == "2.5"
    with pytest.raises(ValueError, match="#### <number>"):
        gold("The answer is 7.")


def test_to_row_appends_the_instruction_and_keeps_only_the_number():
    row = to_row({"question": " How many? ", "answer": "3 + 4 = 7\n#### 7"})
    assert row == {"prompt": f"How many? {INSTRUCTION}", "answer": "7"}
    assert to_row({"question": "Q", "answer": "#### 1"}, instruction="") == {
        "prompt": "Q",
        "answer": "1",
    }
    with pytest.raises(ValueError, match="'question'"):
        to_row({"problem": "Q", "answer": "#### 1"})


def test_prepare_writes_the_committed_prompts_from_the_committed_records(tmp_path):
    out = tmp_path / "train.jsonl"
    assert prepare(RECIPE / "data" / "gsm8k_sample.jsonl", out) == 16
    assert out.read_text() == (RECIPE / "data" / "train.jsonl").read_text()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["answer"] == "15" and rows[10]["answer"] == "1500"
    assert [r["answer"] for r in rows[-2:]] == ["-4", "1.5"]
    # the recipe's reward scores every committed worked solution as correct
    records = [json.loads(line) for line in (RECIPE / "data" / "gsm8k_sample.jsonl").open()]
    pairs = zip(records, rows, strict=True)
    assert all(final_answer(r["answer"], row["answer"]) == 1.0 for r, row in pairs)


def test_prepare_limit_and_a_bad_record_names_its_number(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"question": "a", "answer": "#### 1"})
        + "\n\n"
        + json.dumps({"question": "b", "answer": "no marker"})
        + "\n"
    )
    assert prepare(src, tmp_path / "one.jsonl", limit=1) == 1
    with pytest.raises(SystemExit, match="record 2: answer does not end with"):
        prepare(src, tmp_path / "all.jsonl")


def test_prepare_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as where it is not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    src = tmp_path / "train.parquet"
    src.write_bytes(b"PAR1")
    with pytest.raises(SystemExit, match="needs pyarrow"):
        prepare(src, tmp_path / "out.jsonl")


@pytest.mark.parametrize(
    ("name", "engine", "backend"), [("smoke", "torch", "torch"), ("gpu", "sglang", "megatron")]
)
def test_recipe_specs_validate_with_the_recipe_reward(name, engine, backend):
    spec = load_spec(RECIPE / f"{name}.yaml")
    assert (spec.rollout.engine, spec.trainer.backend) == (engine, backend)
    assert spec.reward.function == "plugin:examples.math.reward:final_answer"
    assert spec.rollout.workflow.chat_template
