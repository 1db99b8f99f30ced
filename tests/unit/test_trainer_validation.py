"""The trainer's admission of pulled groups (validation.py), exact reasons and verdicts; the
bounded trained-id record and its place in the checkpoint state."""

from __future__ import annotations

import json
import math

import pytest

from asyncrl.types import Sample, TrajectoryGroup
from services.trainer.checkpoint import (
    CheckpointState,
    checkpoint_root,
    latest_checkpoint,
    write_checkpoint,
)
from services.trainer.validation import Admission, RecentIds, Verdict, invalid_reason, triage

A = Admission(experiment_id="e", vocab_size=10, trainer_version=3, eta=1)


def _sample(out=(4, 5), lps=None, versions=None, loss_mask=()) -> Sample:
    return Sample(
        output_ids=list(out),
        logprobs=list(lps if lps is not None else [-1.0] * len(out)),
        versions=list(versions if versions is not None else [3] * len(out)),
        loss_mask=list(loss_mask),
    )


def _group(samples=None, experiment_id="e", start_version=3, prompt_ids=(1, 2), gid="g"):
    return TrajectoryGroup(
        experiment_id=experiment_id,
        group_id=gid,
        prompt_id="p",
        prompt="q",
        answer="a",
        prompt_ids=list(prompt_ids),
        samples=[_sample(), _sample()] if samples is None else samples,
        start_version=start_version,
    )


def test_invalid_reason_well_formed_group_empty():
    assert invalid_reason(_group(), A) == ""
    assert invalid_reason(_group([_sample(loss_mask=[1, 0])]), A) == ""
    assert invalid_reason(_group([_sample(out=(0, 9), versions=[0, 3])]), A) == ""
    assert invalid_reason(_group([_sample(out=()), _sample(versions=[2, 3])]), A) == ""


def test_invalid_reason_finite_logprobs_whose_sum_overflows_well_formed():
    assert invalid_reason(_group([_sample(lps=[-1e308, -1e308])]), A) == ""


@pytest.mark.parametrize(
    ("group", "reason"),
    [
        (_group(experiment_id="other"), "experiment 'other' is not 'e'"),
        (_group(samples=[]), "no samples"),
        (_group(start_version=4), "start_version 4 outside [0, trainer version 3]"),
        (_group(start_version=-1), "start_version -1 outside [0, trainer version 3]"),
        (_group(prompt_ids=(1, 10)), "prompt_ids: token id 10 outside [0, 10)"),
        (_group(prompt_ids=(-2, 1)), "prompt_ids: token id -2 outside [0, 10)"),
        (
            _group([_sample(), _sample(lps=[-1.0])]),
            "sample 1: 1 logprobs for 2 output_ids",
        ),
        (_group([_sample(versions=[3, 3, 3])]), "sample 0: 3 versions for 2 output_ids"),
        (_group([_sample(loss_mask=[1])]), "sample 0: 1 loss_mask for 2 output_ids"),
        (_group([_sample(out=(4, 12))]), "sample 0 output_ids: token id 12 outside [0, 10)"),
        (_group([_sample(out=(-1, 4))]), "sample 0 output_ids: token id -1 outside [0, 10)"),
        (
            _group([_sample(versions=[3, 4])]),
            "sample 0: version 4 outside [0, trainer version 3]",
        ),
        (
            _group([_sample(versions=[-1, 3])]),
            "sample 0: version -1 outside [0, trainer version 3]",
        ),
        (
            _group([_sample(), _sample(versions=[4, 4])]),
            "sample 1: version 4 outside [0, trainer version 3]",
        ),
        (
            _group([_sample(versions=[-1, -1])]),
            "sample 0: version -1 outside [0, trainer version 3]",
        ),
        (_group([_sample(out=(), lps=[-1.0])]), "sample 0: 1 logprobs for 0 output_ids"),
        (_group([_sample(out=(), versions=[3])]), "sample 0: 1 versions for 0 output_ids"),
        (
            _group([_sample(versions=[3, 2]), _sample(out=(4, 10))]),
            "sample 1 output_ids: token id 10 outside [0, 10)",
        ),
        (_group([_sample(lps=[-1.0, math.nan])]), "sample 0: a logprob is not finite"),
        (_group([_sample(lps=[-math.inf, -1.0])]), "sample 0: a logprob is not finite"),
        (_group([_sample(lps=[math.inf, -math.inf])]), "sample 0: a logprob is not finite"),
    ],
)
def test_invalid_reason_bad_group_names_exact_reason(group, reason):
    assert invalid_reason(group, A) == reason


def test_triage_bad_before_replay_before_stale():
    trained = {"g"}
    assert triage(_group(experiment_id="x"), A, trained) == (
        Verdict.BAD,
        "experiment 'x' is not 'e'",
    )
    stale_replay = _group(start_version=1, samples=[_sample(versions=[1, 1])])
    assert triage(stale_replay, A, trained) == (Verdict.REPLAY, "")
    assert triage(stale_replay, A, set()) == (Verdict.STALE, "")  # staleness 2 > eta 1
    assert triage(_group(start_version=2), A, set()) == (Verdict.TRAIN, "")  # 1 == eta: kept


def test_triage_id_taken_into_the_batch_is_a_replay():
    assert triage(_group(gid="a"), A, set(), taken={"a"}) == (Verdict.REPLAY, "")
    assert triage(_group(gid="b"), A, set(), taken={"a"}) == (Verdict.TRAIN, "")


def test_recent_ids_over_capacity_forgets_oldest_first():
    ids = RecentIds(["a", "b", "c"], capacity=3)
    ids.add("b")  # already there: no change
    assert list(ids) == ["a", "b", "c"]
    ids.extend(["d", "e"])
    assert list(ids) == ["c", "d", "e"]
    assert ("a" in ids, "b" in ids, "c" in ids, "e" in ids) == (False, False, True, True)
    assert len(ids) == 3


def _save_marker(d):
    (d / "marker").write_text("x")


def test_checkpoint_state_trained_ids_round_trip(tmp_path):
    root = checkpoint_root(tmp_path, "e")
    state = CheckpointState("e", step=2, version=2, last_seq=9, trained_ids=("g0", "g1"))
    write_checkpoint(root, state, _save_marker)
    _, back = latest_checkpoint(root)
    assert back == state


def test_checkpoint_state_without_trained_ids_reads_as_none_trained(tmp_path):
    d = checkpoint_root(tmp_path, "e") / "step_000001"
    (d / "backend").mkdir(parents=True)
    old = {"experiment_id": "e", "step": 1, "version": 1, "last_seq": 4}
    (d / "state.json").write_text(json.dumps(old))
    _, back = latest_checkpoint(checkpoint_root(tmp_path, "e"))
    assert back == CheckpointState("e", 1, 1, 4, trained_ids=())
