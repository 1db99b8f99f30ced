"""The persisted experiment record stays bounded however long the run (history lives in the
history log), and the in-memory history keeps one lineage."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from asyncrl.ticket import Ticket
from asyncrl.types import EvalResult, StepMetrics
from services.scheduler.history import HistoryLog, history_subject
from services.scheduler.records import (
    KEPT,
    ExperimentRecord,
    ExperimentState,
    Progress,
    flat_dict,
)


def _record() -> ExperimentRecord:
    spec = {"name": "x", "model": {"path": "/m" * 100}, "dataset": {"path": "/d" * 100}}
    return ExperimentRecord(id="x-000000", name="x", spec=spec, weight_uris={0: "/m"})


def test_record_after_10000_steps_serialized_under_64_kib():
    record = _record()
    for v in range(1, 10_001):
        step = StepMetrics(step=v, version=v, loss=0.123456789, reward_mean=0.5, groups=8)
        record.add_step(step)
        record.add_weights(v, f"file:///var/weights/x-000000/v{v:06d}")
        record.evals.append(EvalResult(version=v, accuracy=0.5, n_prompts=100, n_samples=100))
        record.failure_reasons[f"reward raised: error {v}"] = 1
    data = record.to_json()
    assert len(data) < 64 * 1024
    restored = ExperimentRecord.from_json(data)
    assert [s.version for s in restored.history] == [10_000]  # the last step; the rest is logged
    assert len(restored.evals) == KEPT and restored.evals[-1].version == 10_000
    assert sorted(restored.weight_uris)[:2] == [0, 10_000 - KEPT + 1]
    assert restored.weight_uris[10_000].endswith("v010000")


def test_add_step_of_an_older_version_replaces_the_discarded_lineage():
    record = _record()
    for v in (1, 2, 3):
        record.add_step(StepMetrics(step=v, version=v, groups=2))
    discarded = record.add_step(StepMetrics(step=2, version=2, groups=2, loss=9.0))
    assert [s.version for s in discarded] == [3, 2]
    assert [(s.version, s.loss) for s in record.history] == [(1, 0.0), (2, 9.0)]


def test_record_round_trip_keeps_progress_and_reasons():
    record = _record()
    record.progress = Progress(version=3, accepted=7, left_over=1)
    record.failure_reasons = {"reward raised": 4}
    restored = ExperimentRecord.from_json(record.to_json())
    assert restored.progress == record.progress
    assert restored.failure_reasons == {"reward raised": 4}


class NoIteration(list):
    """A history that fails if anything walks or copies it whole."""

    def __iter__(self):
        raise AssertionError("to_json walked the whole history")


def test_record_to_json_reads_only_last_step_of_history():
    record = _record()
    record.history = NoIteration(StepMetrics(step=v, version=v, groups=2) for v in range(1, 4))
    record.evals = NoIteration(EvalResult(version=v, accuracy=0.5) for v in range(1, 100))
    restored = ExperimentRecord.from_json(record.to_json())
    assert [s.version for s in restored.history] == [3]
    assert [e.version for e in restored.evals] == list(range(100 - KEPT, 100))


def test_flat_dict_of_steps_evals_progress_equals_asdict_in_field_order():
    items = [
        StepMetrics(step=3, version=3, loss=0.25, groups=8, fleet_update_s=0.5),
        EvalResult(version=2, accuracy=0.75, n_prompts=4, n_samples=16),
        Progress(version=5, accepted=7, rollout_tokens_per_s=1.5),
    ]
    for item in items:
        assert list(flat_dict(item).items()) == list(asdict(item).items())


def test_history_entries_encode_as_asdict_did():
    """The history log's bytes are what `{"step": asdict(step)}` encoded to before."""
    step = StepMetrics(step=3, version=3, loss=0.25, groups=8)
    result = EvalResult(version=2, accuracy=0.75, n_samples=16)
    log = HistoryLog(js=None)
    log.append_step("x-000000", step)
    log.append_eval("x-000000", result)
    entries = [log._queue.get_nowait() for _ in range(2)]
    assert entries == [
        (history_subject("x-000000"), json.dumps({"step": asdict(step)}).encode()),
        (history_subject("x-000000"), json.dumps({"eval": asdict(result)}).encode()),
    ]


def test_the_flusher_waits_its_interval_or_nine_times_what_a_large_flush_took():
    from services.scheduler.state import flush_pause

    assert flush_pause(0.0015, 0.2) == 0.2  # B = 32: a record of 16 KB, ~1.5 ms
    assert flush_pause(0.065, 0.2) == pytest.approx(0.585)  # B = 2,048: ~1 MB, ~65 ms
    assert flush_pause(0.0, 0.5) == 0.5


def test_reopen_cancelled_record_sends_cancelled_tickets_first_and_clears_left_over():
    record = ExperimentRecord(id="e", name="e", spec={}, state=ExperimentState.CANCELLED)
    record.cancelled = [Ticket(0, 3), Ticket(0, 5, attempt=1)]
    record.progress.left_over = 4
    record = ExperimentRecord.from_json(record.to_json())  # persisted as it is
    assert record.cancelled == [Ticket(0, 3), Ticket(0, 5, attempt=1)]
    record.reopen("resumed from CANCELLED")
    assert (record.state, record.message) == (ExperimentState.PENDING, "resumed from CANCELLED")
    assert record.inflight == [Ticket(0, 3), Ticket(0, 5, attempt=1)]
    assert (record.cancelled, record.progress.left_over) == ([], 0)


@pytest.mark.parametrize("state", [ExperimentState.COMPLETED, ExperimentState.RUNNING])
def test_reopen_of_a_state_not_resumable_is_a_bug(state):
    record = ExperimentRecord(id="e", name="e", spec={}, state=state)
    with pytest.raises(AssertionError):
        record.reopen("resumed")
