"""The trainer's pure parts: the staleness rule, step metrics and the resume position."""

from __future__ import annotations

import json

import pytest

from asyncrl.types import RewardStatus, Sample, TrajectoryGroup
from services.trainer.checkpoint import (
    CheckpointState,
    checkpoint_root,
    consumer_start_seq,
    latest_checkpoint,
    write_checkpoint,
)
from services.trainer.metrics import drop_reason, is_too_stale, step_metrics


def _group(gid: str, start_version: int, rewards=(1.0, 0.0), statuses=None) -> TrajectoryGroup:
    statuses = statuses or [RewardStatus.OK] * len(rewards)
    samples = [
        Sample(
            output_ids=[5], logprobs=[-1.0], versions=[start_version], reward=r, reward_status=st
        )
        for r, st in zip(rewards, statuses, strict=True)
    ]
    return TrajectoryGroup(
        experiment_id="e",
        group_id=gid,
        prompt_id="p" + gid,
        prompt="q",
        answer="a",
        prompt_ids=[1, 2],
        samples=samples,
        start_version=start_version,
    )


def test_too_stale_eta0_same_version_is_fresh():
    assert not is_too_stale(_group("a", 3), trainer_version=3, eta=0)
    assert is_too_stale(_group("a", 2), trainer_version=3, eta=0)


def test_too_stale_only_above_eta():
    groups = [_group("a", 5), _group("b", 2), _group("c", 3), _group("d", 1)]
    stale = [g.group_id for g in groups if is_too_stale(g, trainer_version=5, eta=2)]
    assert stale == ["b", "d"]  # staleness 3 and 4; "c" at 2 (== eta) is kept


def test_drop_reason_names_staleness_and_eta():
    assert drop_reason(_group("a", 1), trainer_version=4, eta=2) == "staleness 3 > eta 2"


def test_step_metrics_over_ok_samples_and_staleness_exact():
    groups = [
        _group("a", 4, rewards=(1.0, 0.0)),
        _group(
            "b",
            3,
            rewards=(1.0, 0.5, 0.0),
            statuses=[RewardStatus.OK, RewardStatus.OK, RewardStatus.FAILED],
        ),
    ]
    m = step_metrics(
        step=7,
        version=5,
        groups=groups,
        trainer_version=4,
        backend_stats={"loss": 0.25, "tokens": 10.0, "grad_norm": 2.0},
        step_time_s=0.5,
        stale_dropped=3,
    )
    assert m.reward_mean == pytest.approx((1.0 + 0.0 + 1.0 + 0.5) / 4)  # FAILED excluded
    assert m.accuracy == pytest.approx(2 / 4)
    assert (m.staleness_max, m.staleness_mean, m.stale_groups) == (1, 0.5, 1)
    assert (m.step, m.version, m.groups, m.stale_dropped) == (7, 5, 2, 3)
    assert m.tokens_per_s == pytest.approx(20.0)
    assert (m.loss, m.grad_norm, m.kl) == (0.25, 2.0, 0.0)


def test_consumer_start_seq_without_checkpoint_is_stream_start():
    assert consumer_start_seq(None) == 1


def test_consumer_start_seq_after_checkpoint_is_next_message():
    st = CheckpointState(experiment_id="e", step=2, version=2, last_seq=17)
    assert consumer_start_seq(st) == 18


def _save_marker(d):
    (d / "weights.bin").write_text("w")


def test_latest_checkpoint_ignores_tmp_and_incomplete_dirs(tmp_path):
    root = checkpoint_root(tmp_path, "e")
    write_checkpoint(root, CheckpointState("e", 1, 1, 4), _save_marker)
    write_checkpoint(root, CheckpointState("e", 2, 2, 9), _save_marker)
    (root / ".tmp-step_000003-abc").mkdir()  # a crash in the middle of writing step 3
    (root / "step_000004").mkdir()  # no state.json: never complete
    path, st = latest_checkpoint(root)
    assert path.name == "step_000002"
    assert st == CheckpointState("e", 2, 2, 9)
    assert (path / "backend" / "weights.bin").read_text() == "w"


def test_write_checkpoint_keeps_newest_two(tmp_path):
    root = tmp_path / "ck"
    for step in (1, 2, 3):
        write_checkpoint(root, CheckpointState("e", step, step, step * 2), _save_marker)
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003"]
    assert json.loads((root / "step_000003" / "state.json").read_text())["last_seq"] == 6


def test_write_checkpoint_backend_error_leaves_no_checkpoint(tmp_path):
    root = tmp_path / "ck"

    def broken(d):
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_checkpoint(root, CheckpointState("e", 1, 1, 1), broken)
    assert latest_checkpoint(root) is None
    assert list(root.iterdir()) == []
