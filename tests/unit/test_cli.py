"""The asyncrl CLI: spec loading and overrides, bad spec files, error exit codes, the
progress view."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from asyncrl.cli import app, load_spec, load_spec_dict
from asyncrl.client import AsyncrlError
from asyncrl.net import free_port
from asyncrl.spec import SpecError
from asyncrl.v1 import common_pb2, scheduler_pb2
from asyncrl.watchview import ProgressView

runner = CliRunner()

SPEC = """\
name: demo
model: {path: /models/tiny}
dataset: {path: /data/train.jsonl}
rollout:
  n_samples: 4
trainer:
  backend: torch
  lr: 1.0e-5
"""


@pytest.fixture
def spec_file(tmp_path) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


def test_load_spec_overrides_set_nested_fields(spec_file):
    spec = load_spec(
        spec_file,
        [
            "trainer.lr=0.001",
            "rollout.gconfig.temperature=0.7",
            "rollout.max_head_offpolicyness=2",
            "name=other",
            "reward.kwargs.pattern=a=b",
            "eval.every_versions=0",
        ],
    )
    assert spec.trainer.lr == pytest.approx(0.001)
    assert spec.rollout.gconfig.temperature == pytest.approx(0.7)
    assert spec.rollout.max_head_offpolicyness == 2
    assert spec.rollout.n_samples == 4  # untouched
    assert spec.name == "other"
    assert dict(spec.reward.kwargs) == {"pattern": "a=b"}
    assert spec.eval.every_versions == 0
    assert spec.trainer.backend == "torch"


def test_load_spec_relative_existing_path_becomes_absolute(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text("model: {path: not/here}\ndataset: {path: data/train.jsonl}\n")
    data = load_spec_dict("s.yaml")
    assert data["dataset"]["path"] == str(tmp_path / "data" / "train.jsonl")
    assert data["model"]["path"] == "not/here"  # left alone: may live on the server


def test_load_spec_unknown_field_raises_spec_error(spec_file):
    with pytest.raises(SpecError, match="bogus"):
        load_spec(spec_file, ["trainer.bogus=1"])


def test_load_spec_override_without_equals_raises_spec_error(spec_file):
    with pytest.raises(SpecError, match="a.b=value"):
        load_spec(spec_file, ["trainer.lr"])


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read"),
        ("model: [unclosed\n", "invalid YAML"),
        ("- a\n- b\n", "must hold a mapping"),
        ("model: {path: x}\nbogus: 1\n", "bogus"),
    ],
)
def test_submit_bad_spec_file_exits_2_with_message(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    if content is not None:
        path.write_text(content)
    result = runner.invoke(app, ["--scheduler", f"127.0.0.1:{free_port()}", "submit", str(path)])
    assert result.exit_code == 2
    assert message in result.output


def test_submit_unreachable_scheduler_exits_2_unavailable(spec_file):
    result = runner.invoke(
        app, ["--scheduler", f"127.0.0.1:{free_port()}", "submit", str(spec_file)]
    )
    assert result.exit_code == 2
    assert "UNAVAILABLE" in result.output


def test_asyncrl_error_str_is_code_and_details():
    import grpc

    e = AsyncrlError(grpc.StatusCode.INVALID_ARGUMENT, "trainer.lr: Input should be greater than 0")
    assert str(e) == "INVALID_ARGUMENT: trainer.lr: Input should be greater than 0"


def test_progress_view_events_fold_into_latest_state():
    view = ProgressView("e1")
    exp = scheduler_pb2.Experiment(id="e1", state=scheduler_pb2.EXPERIMENT_STATE_RUNNING)
    exp.progress.version = 2
    exp.progress.accepted = 7
    exp.progress.evals.add(version=0, accuracy=0.25)
    view.update(scheduler_pb2.ProgressEvent(kind="snapshot", experiment=exp))
    view.update(
        scheduler_pb2.ProgressEvent(
            kind="step",
            step=common_pb2.StepMetrics(
                step=3, version=3, reward_mean=0.625, staleness_max=1, staleness_mean=0.5
            ),
        )
    )
    view.update(
        scheduler_pb2.ProgressEvent(
            kind="eval", eval=scheduler_pb2.EvalResult(version=3, accuracy=0.75)
        )
    )
    assert view.last_step.reward_mean == 0.625
    assert view.last_eval.accuracy == 0.75

    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(view.render())
    text = console.export_text()
    assert "RUNNING" in text and "accepted 7" in text
    assert "0.625" in text and "0.750 (v3)" in text
    line = view.line("step")
    assert line.startswith("[step] RUNNING v2") and "reward=0.625" in line and "eval=0.750" in line


def test_submit_hints_name_each_logger_dir_under_runs(monkeypatch, tmp_path):
    from asyncrl.runlog import run_log_hints

    monkeypatch.setenv("ASYNCRL_VAR", str(tmp_path))
    runs = tmp_path.absolute() / "runs" / "exp-1"
    assert run_log_hints("exp-1", []) == []
    tb, wandb = run_log_hints("exp-1", ["tensorboard", "wandb"])
    assert tb == f"TensorBoard: tensorboard --logdir {runs / 'tensorboard'}"
    assert wandb.startswith(f"W&B: {runs / 'wandb'}")


def test_logs_tails_the_service_logs_of_the_var_dir(monkeypatch, tmp_path):
    (tmp_path / "log").mkdir()
    for name in ("trainer-0.log", "rollout-0.log", "rollout-1.log"):
        (tmp_path / "log" / name).write_text("line\n")
    calls = []
    monkeypatch.setattr("os.execvp", lambda prog, argv: calls.append(argv))
    result = runner.invoke(app, ["logs", "rollout", "--follow", "--var", str(tmp_path)])
    assert result.exit_code == 0, result.output
    logs = [str(tmp_path / "log" / f"rollout-{i}.log") for i in (0, 1)]
    assert calls == [["tail", "-n", "50", "-F", *logs]]
    result = runner.invoke(app, ["logs", "reward", "--var", str(tmp_path)])
    assert result.exit_code == 1 and "no logs for reward" in result.output


def test_checkpoint_unreachable_scheduler_exits_2_unavailable():
    result = runner.invoke(app, ["--scheduler", f"127.0.0.1:{free_port()}", "checkpoint", "x"])
    assert result.exit_code == 2 and "UNAVAILABLE" in result.output


def test_resume_unreachable_scheduler_exits_2_unavailable():
    result = runner.invoke(app, ["--scheduler", f"127.0.0.1:{free_port()}", "resume", "x"])
    assert result.exit_code == 2 and "UNAVAILABLE" in result.output
