"""Run summary numbers and plots from a hand-made experiment history."""

from __future__ import annotations

import json
import os

import pytest
from google.protobuf import json_format
from rich.console import Console

from asyncrl.machine import cpu_model
from asyncrl.report import plot_experiment, summarize, token_versions, write_summary
from asyncrl.v1 import common_pb2, scheduler_pb2

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_experiment() -> scheduler_pb2.Experiment:
    exp = scheduler_pb2.Experiment(
        id="exp1", name="tiny", state=scheduler_pb2.EXPERIMENT_STATE_COMPLETED
    )
    spec = {"model": {"path": "m"}, "dataset": {"path": "d"}}
    exp.spec_json = json.dumps(spec | {"rollout": {"max_head_offpolicyness": 2}})
    p = exp.progress
    p.version, p.accepted, p.rejected, p.failed = 3, 13, 5, 1
    p.stale_dropped, p.trained_groups, p.staleness_max = 2, 12, 1
    # Evals out of order on purpose: initial = lowest version, final = highest.
    p.evals.add(version=3, accuracy=0.5, reward_mean=0.5, n_prompts=10)
    p.evals.add(version=0, accuracy=0.1, reward_mean=0.1, n_prompts=10)
    for v, (stale, smax, reward) in enumerate([(0, 0, 0.2), (1, 1, 0.3), (2, 2, 0.4)], start=1):
        exp.history.append(
            common_pb2.StepMetrics(
                step=v,
                version=v,
                groups=4,
                stale_groups=stale,
                staleness_max=smax,
                staleness_mean=stale / 4,
                reward_mean=reward,
            )
        )
    return exp


def test_summarize_hand_made_history_exact_numbers():
    s = summarize(make_experiment(), wall_seconds=12.5)
    assert s["stale_fraction"] == pytest.approx(3 / 12)
    assert s["initial_eval_accuracy"] == 0.1 and s["initial_eval_version"] == 0
    assert s["final_eval_accuracy"] == 0.5 and s["final_eval_version"] == 3
    assert s["steps"] == 3
    assert s["max_staleness"] == 2
    assert s["max_head_offpolicyness"] == 2
    assert s["wall_seconds"] == 12.5
    assert s["final_reward_mean"] == pytest.approx(0.4)
    assert (s["accepted"], s["rejected"], s["failed"], s["stale_dropped"], s["trained_groups"]) == (
        13,
        5,
        1,
        2,
        12,
    )
    assert s["state"] == "COMPLETED"


def test_summarize_dict_input_matches_proto_input():
    exp = make_experiment()
    camel = json_format.MessageToDict(exp)
    snake = json_format.MessageToDict(exp, preserving_proto_field_name=True)
    assert summarize(camel, 1.0) == summarize(exp, 1.0) == summarize(snake, 1.0)


def test_summarize_empty_history_zero_fraction_no_evals():
    spec = json.dumps({"model": {"path": "m"}, "dataset": {"path": "d"}})
    s = summarize(scheduler_pb2.Experiment(id="e", spec_json=spec), wall_seconds=0.0)
    assert s["stale_fraction"] == 0.0
    assert s["steps"] == 0
    assert s["initial_eval_accuracy"] is None and s["final_eval_accuracy"] is None
    assert s["max_staleness"] == 0


def test_plot_experiment_history_writes_png(tmp_path):
    out = plot_experiment(make_experiment(), tmp_path / "sub" / "curve.png")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_write_summary_out_dir_has_json_and_png(tmp_path):
    console = Console(record=True, width=120)
    write_summary(make_experiment(), 7.0, tmp_path, console=console)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stale_fraction"] == pytest.approx(0.25)
    assert summary["wall_seconds"] == 7.0
    assert (tmp_path / "reward.png").read_bytes().startswith(PNG_MAGIC)
    assert "stale_fraction" in console.export_text()


def test_write_summary_prints_and_stores_the_machine_line(tmp_path):
    """A wall time names the machine it came from (issue 24): the demo's summary carries the
    same line the bench report does (asyncrl.machine)."""
    console = Console(record=True, width=200)
    write_summary(make_experiment(), 7.0, tmp_path, console=console)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["machine"].startswith(f"{cpu_model()} · {os.cpu_count()} cores")
    assert " · load " in summary["machine"]
    assert summary["machine"] in console.export_text()


@pytest.mark.parametrize(
    ("version", "low", "high", "shown"),
    [
        (0, 0, 0, "v0"),  # the first round, held alone (eval.before_training)
        (10, 10, 13, "v10-v13"),  # the fleet moved on while the round ran
        (10, 11, 11, "v11"),  # every prompt started after the next version landed
        (10, 0, 0, "-"),  # a round recorded before EvalResult carried its versions
    ],
)
def test_token_versions_names_the_versions_that_generated_an_eval(version, low, high, shown):
    e = scheduler_pb2.EvalResult(version=version, min_version=low, max_version=high)
    assert token_versions(e) == shown
