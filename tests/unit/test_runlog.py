"""asyncrl.runlog: every StepMetrics and EvalResult field in TensorBoard and W&B (offline),
read back with the libraries' own readers."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.runlog import (
    WEIGHT_UPDATE_PHASES,
    RunLog,
    eval_scalars,
    step_scalars,
    wandb_mode,
)
from asyncrl.spec import SpecError, validate_spec
from asyncrl.types import EvalResult, StepMetrics
from tests.runlogs import tensorboard_scalars, wandb_history

STEP_FIELDS = [f.name for f in dataclasses.fields(StepMetrics)]


def _step(version: int) -> StepMetrics:
    """A step whose every field holds a different value: field i = version * 100 + i."""
    m = StepMetrics(**{name: i for i, name in enumerate(STEP_FIELDS)})
    for i, name in enumerate(STEP_FIELDS):
        setattr(m, name, type(getattr(m, name))(version * 100 + i))
    m.version = version
    return m


def test_step_scalars_name_every_field_by_group():
    scalars = step_scalars(_step(2))
    expected = {
        f"{'weight_update' if name in WEIGHT_UPDATE_PHASES else 'train'}/{name}": 200.0 + i
        for i, name in enumerate(STEP_FIELDS)
        if name != "version"
    }
    assert scalars == expected
    assert "train/loss" in scalars and "weight_update/serialize_s" in scalars
    assert set(WEIGHT_UPDATE_PHASES) <= set(STEP_FIELDS)  # a renamed phase fails here


def test_eval_scalars():
    result = EvalResult(
        version=4,
        accuracy=0.5,
        reward_mean=0.25,
        n_prompts=8,
        n_samples=8,
        min_version=4,
        max_version=6,
    )
    assert eval_scalars(result) == {
        "eval/accuracy": 0.5,
        "eval/reward_mean": 0.25,
        "eval/n_prompts": 8.0,
        "eval/n_samples": 8.0,
        "eval/failed": 0.0,
        "eval/min_version": 4.0,
        "eval/max_version": 6.0,
    }


@pytest.mark.parametrize(
    ("env", "mode"),
    [
        ({}, "offline"),
        ({"WANDB_API_KEY": "k"}, "online"),
        ({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, "offline"),
        ({"WANDB_MODE": "disabled"}, "disabled"),
    ],
)
def test_wandb_mode(env, mode):
    assert wandb_mode(env) == mode


def test_unknown_logger_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown loggers \\['mlflow'\\]"):
        RunLog(tmp_path, ["tensorboard", "mlflow"], "x")


def test_no_logger_writes_nothing(tmp_path):
    runlog = RunLog(tmp_path / "run", [], "x")
    runlog.step(_step(1))
    runlog.close()
    assert not (tmp_path / "run").exists()


def test_tensorboard_and_wandb_hold_every_step_and_eval(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    runlog = RunLog(tmp_path, ["tensorboard", "wandb"], "exp-abc123", config={"seed": 3})
    runlog.eval(EvalResult(version=0, accuracy=0.125, n_prompts=8))
    for v in (1, 2, 3):
        runlog.step(_step(v))
    runlog.eval(EvalResult(version=3, accuracy=0.625, n_prompts=8))
    runlog.close()
    runlog.step(_step(4))  # after close: ignored

    tb = tensorboard_scalars(tmp_path / "tensorboard")
    for i, name in enumerate(STEP_FIELDS):
        if name == "version":
            continue
        tag = f"{'weight_update' if name in WEIGHT_UPDATE_PHASES else 'train'}/{name}"
        assert tb[tag] == [(1, 100.0 + i), (2, 200.0 + i), (3, 300.0 + i)], tag
    assert tb["eval/accuracy"] == [(0, 0.125), (3, 0.625)]

    rows = wandb_history(tmp_path / "wandb")
    steps = [r for r in rows if "train/loss" in r]
    loss = STEP_FIELDS.index("loss")
    assert [(r["version"], r["train/loss"]) for r in steps] == [
        (1, 100.0 + loss),
        (2, 200.0 + loss),
        (3, 300.0 + loss),
    ]
    commit = STEP_FIELDS.index("commit_s")
    assert [r["weight_update/commit_s"] for r in steps] == [
        100.0 + commit,
        200.0 + commit,
        300.0 + commit,
    ]
    evals = [(r["version"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    assert evals == [(0, 0.125), (3, 0.625)]


def _spec(**trainer) -> dict:
    return {"model": {"path": "m"}, "dataset": {"path": "d.jsonl"}, "trainer": trainer}


def test_spec_loggers_default_and_bad_values():
    assert validate_spec(_spec()).trainer.loggers == ["tensorboard"]
    assert validate_spec(_spec(loggers=["wandb"])).trainer.loggers == ["wandb"]
    assert validate_spec(_spec(loggers=[])).trainer.loggers == []
    with pytest.raises(SpecError) as e:
        validate_spec(_spec(loggers=["tensorboard", "mlflow"]))
    assert e.value.field == "trainer.loggers.1"
    with pytest.raises(SpecError, match="a logger is named twice") as e:
        validate_spec(_spec(loggers=["wandb", "wandb"]))
    assert e.value.field == "trainer.loggers"
