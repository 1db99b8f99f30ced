"""`asyncrl watch`: plain lines for logs and CI, a live view that stays in place on a terminal."""

from __future__ import annotations

import asyncio
import io
import re

from rich.console import Console

from asyncrl.spec import spec_to_json, validate_spec
from asyncrl.v1 import common_pb2, scheduler_pb2
from asyncrl.watchview import ProgressView, duration, follow

CREATED_MS = 1_700_000_000_000
SPEC = spec_to_json(
    validate_spec(
        {
            "name": "arith",
            "model": {"path": "m"},
            "dataset": {"path": "d.jsonl"},
            "rollout": {"max_head_offpolicyness": 2},
            "trainer": {"total_steps": 4},
        }
    )
)
RUNNING = scheduler_pb2.EXPERIMENT_STATE_RUNNING
COMPLETED = scheduler_pb2.EXPERIMENT_STATE_COMPLETED


def _experiment(state: int, version: int, accepted: int) -> scheduler_pb2.Experiment:
    exp = scheduler_pb2.Experiment(
        id="arith-0a1b2c", name="arith", state=state, spec_json=SPEC, created_unix_ms=CREATED_MS
    )
    exp.progress.version = version
    exp.progress.accepted = accepted
    return exp


def _step(version: int, loss: float, reward: float) -> common_pb2.StepMetrics:
    return common_pb2.StepMetrics(
        step=version,
        version=version,
        loss=loss,
        reward_mean=reward,
        staleness_max=1,
        staleness_mean=0.5,
        serialize_s=0.012,
        commit_s=0.004,
    )


EVENTS = [
    scheduler_pb2.ProgressEvent(kind="snapshot", experiment=_experiment(RUNNING, 0, 0)),
    scheduler_pb2.ProgressEvent(
        kind="eval", eval=scheduler_pb2.EvalResult(version=0, accuracy=0.125, reward_mean=0.125)
    ),
    scheduler_pb2.ProgressEvent(kind="snapshot", experiment=_experiment(RUNNING, 0, 16)),
    scheduler_pb2.ProgressEvent(kind="step", step=_step(1, 0.5, 0.25)),
    scheduler_pb2.ProgressEvent(kind="step", step=_step(2, 0.25, 0.5)),
    scheduler_pb2.ProgressEvent(
        kind="eval",
        eval=scheduler_pb2.EvalResult(
            version=2, accuracy=0.625, reward_mean=0.5, min_version=2, max_version=3
        ),
    ),
    scheduler_pb2.ProgressEvent(kind="state", experiment=_experiment(COMPLETED, 2, 32)),
]


async def _stream(events):
    for event in events:
        yield event


def _follow(plain: bool, terminal: bool) -> tuple[ProgressView, str]:
    buffer = io.StringIO()
    console = Console(file=buffer, width=160, force_terminal=terminal, highlight=False)
    view = ProgressView("arith-0a1b2c")
    asyncio.run(follow(_stream(EVENTS), view, console, plain))
    return view, buffer.getvalue()


def test_plain_mode_one_line_per_step_eval_and_state_change():
    view, text = _follow(plain=True, terminal=False)
    counts = "accepted={} rejected=0 failed=0 stale_dropped=0 running=0 left_over=0"
    assert text.splitlines() == [
        f"[snapshot] RUNNING v0 step=0/4 {counts.format(0)} reward=- loss=- eval=- staleness_max=0",
        f"[eval] RUNNING v0 step=0/4 {counts.format(0)} reward=- loss=- eval=0.125 staleness_max=0",
        # the second snapshot: no line
        f"[step] RUNNING v0 step=1/4 {counts.format(16)} reward=0.250 loss=0.5000 eval=0.125"
        " staleness_max=1",
        f"[step] RUNNING v0 step=2/4 {counts.format(16)} reward=0.500 loss=0.2500 eval=0.125"
        " staleness_max=1",
        f"[eval] RUNNING v0 step=2/4 {counts.format(16)} reward=0.500 loss=0.2500 eval=0.625"
        " staleness_max=1",
        f"[state] COMPLETED v2 step=2/4 {counts.format(32)} reward=0.500 loss=0.2500 eval=0.625"
        " staleness_max=1",
    ]
    assert view.total_steps == 4 and view.eta == 2
    assert sorted(view.evals) == [0, 2]


def test_live_view_shows_progress_latest_step_and_evals():
    view = ProgressView("arith-0a1b2c")
    for event in EVENTS[:-1]:
        view.update(event)
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(view.live(now=CREATED_MS / 1000 + 30))  # 2 of 4 steps in 30 s
    lines = [line.rstrip() for line in console.export_text().splitlines()]
    assert lines[0] == "experiment arith-0a1b2c arith"
    assert lines[1].endswith("  2/4 steps  elapsed 0:30  left ~0:30")
    assert lines[1].startswith("━" * 20)  # half of the 40-wide bar
    rows = {line[:16].strip(): line[16:] for line in lines[2:] if line[:16].strip()}
    assert rows["state"] == "RUNNING"
    assert rows["groups"] == "accepted 16  rejected 0  failed 0  running 0  trained 0"
    assert rows["step 2"] == "loss 0.2500  reward 0.500  accuracy 0.000"
    assert rows["weight update"] == (
        "serialize 0.012s  write 0.000s  commit 0.004s  fleet 0.000s  lag 0.000s"
    )
    assert rows["staleness"] == "max 1  mean 0.50  (η = 2)"
    assert [line.split() for line in lines[-3:]] == [
        ["evals", "version", "accuracy", "reward", "mean", "tokens", "from", "failed"],
        ["0", "0.125", "0.125", "v0", "0"],
        ["2", "0.625", "0.500", "v2-v3", "0"],
    ]
    assert max(len(line) for line in lines) <= 90  # fits a narrow terminal


def test_live_mode_redraws_in_place():
    view, raw = _follow(plain=False, terminal=True)
    assert "\x1b[1A" in raw and "\x1b[2K" in raw  # cursor up, erase line: drawn over itself
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)  # the frames, styles and moves left out
    assert "[step]" not in text
    last_frame = text.rsplit("experiment ", 1)[1]
    assert last_frame.startswith("arith-0a1b2c arith\n")
    assert "COMPLETED" in last_frame and "2/4 steps" in last_frame and "0.625" in last_frame
    assert view.experiment.state == COMPLETED


def test_duration():
    assert duration(0) == "0:00"
    assert duration(59.6) == "1:00"
    assert duration(3723) == "1:02:03"
