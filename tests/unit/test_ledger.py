"""The ledger's summary: each prompt's fate from hand-written event sequences."""

from __future__ import annotations

import pytest

from asyncrl.ledger import counted_steps, summarize, unaccounted, well_formed


def dispatched(group: str, index: int, epoch: int = 0, attempt: int = 0) -> dict:
    return {
        "event": "dispatched",
        "group": group,
        "prompt": f"p{index}",
        "epoch": epoch,
        "index": index,
        "attempt": attempt,
    }


def settled(group: str, status: str = "accepted", reason: str = "", duplicate=False) -> dict:
    return {
        "event": "settled",
        "group": group,
        "status": status,
        "reason": reason,
        "duplicate": duplicate,
    }


def trained(step: int, *groups: str) -> dict:
    return {"event": "trained", "step": step, "version": step, "groups": list(groups), "run": "r"}


def test_every_fate_counted_once_per_prompt():
    events = [
        {"event": "started", "prompts": 6, "epochs": 1},
        *(dispatched(f"g{i}", i) for i in range(6)),
        settled("g0"),
        settled("g1"),
        settled("g2", "rejected", "constant reward 0"),
        settled("g3", "failed", "all 4 samples failed: ValueError"),
        settled("g4"),
        trained(1, "g0", "g1"),
        {"event": "left_over", "groups": ["g4"]},
        # g5: dispatched, never heard of again
    ]
    report = summarize(events)
    assert report.totals == {
        "trained": 2,
        "trained_twice": 0,
        "filtered": 1,
        "failed": 1,
        "left_over": 1,
        "lost": 0,
        "in_flight": 1,
    }
    assert (report.steps, report.trained_groups) == (1, 2)
    assert report.dataset["prompts"] == 6
    fates = {p.prompt: (p.fate, p.reason) for p in report.prompts}
    assert fates["p3"] == ("failed", "all 4 samples failed: ValueError")
    assert report.prompts[0].trained == [(1, 1)]


def test_accepted_never_trained_nor_reported_is_lost():
    report = summarize([dispatched("g0", 0), settled("g0")])
    assert report.totals["lost"] == 1


def test_retry_same_group_then_trained_once_and_duplicate_counted():
    events = [
        dispatched("g0", 0),
        {"event": "retried", "group": "g0", "reason": "rollout lost"},
        dispatched("g0", 0),
        settled("g0", duplicate=True),
        trained(1, "g0"),
    ]
    report = summarize(events)
    assert report.totals["trained"] == 1 and report.totals["trained_twice"] == 0
    assert report.duplicates == 1
    assert report.prompts[0].groups == ["g0"]


def test_two_attempts_of_one_prompt_both_trained_is_trained_twice():
    events = [
        dispatched("a0", 0),
        settled("a0"),
        dispatched("a1", 0, attempt=1),
        settled("a1"),
        trained(1, "a0"),
        trained(2, "a1"),
    ]
    assert summarize(events).totals["trained_twice"] == 1


def test_stale_drop_then_new_attempt_trained_is_trained_once():
    events = [
        dispatched("a0", 0),
        {"event": "dropped", "group": "a0", "reason": "staleness 3 > eta 2"},
        dispatched("a1", 0, attempt=1),
        settled("a1"),
        trained(1, "a1"),
    ]
    report = summarize(events)
    assert report.totals["trained"] == 1
    assert report.prompts[0].groups == ["a0", "a1"]


def test_rewind_discards_steps_after_the_checkpoint():
    events = [
        dispatched("g0", 0),
        dispatched("g1", 1),
        settled("g0"),
        settled("g1"),
        trained(1, "g0"),
        trained(2, "g1"),
        {"event": "rewound", "to_step": 1, "run": "r2"},
        {**trained(2, "g1"), "run": "r2"},
    ]
    assert [s["step"] for s in counted_steps(events)] == [1, 2]
    report = summarize(events)
    assert report.totals["trained"] == 2 and report.totals["trained_twice"] == 0
    assert report.steps == 2


def test_rewind_discards_an_earlier_runs_steps_stored_after_it():
    """A trainer failed while NATS could not store (disk full): its writer stored step 2 only
    after its successor resumed at step 1 and trained step 2 again (chaos `disk-full`)."""
    events = [
        {"event": "rewound", "to_step": 0, "run": "r1"},
        dispatched("g0", 0),
        dispatched("g1", 1),
        settled("g0"),
        settled("g1"),
        {**trained(1, "g0"), "run": "r1"},
        {"event": "rewound", "to_step": 1, "run": "r2"},
        {**trained(2, "g1"), "run": "r2"},
        {**trained(2, "g1"), "run": "r1"},  # r1's, stored late
        {**trained(3, "g1"), "run": "r1"},
    ]
    standing = [(s["step"], s["run"]) for s in counted_steps(events)]
    assert standing == [(1, "r1"), (2, "r2")]
    report = summarize(events)
    assert report.totals["trained"] == 2 and report.totals["trained_twice"] == 0
    assert report.steps == 2


def test_rewind_without_run_ids_keeps_later_steps():
    """Ledgers written before run ids: a rewound caps no run."""
    events = [
        {"event": "trained", "step": 1, "groups": ["g0"]},
        {"event": "trained", "step": 2, "groups": ["g1"]},
        {"event": "rewound", "to_step": 1},
        {"event": "trained", "step": 2, "groups": ["g1"]},
    ]
    assert [s["step"] for s in counted_steps(events)] == [1, 2]


def test_quarantined_counted():
    events = [{"event": "quarantined", "group": "x", "reason": "foreign experiment"}]
    assert summarize(events).quarantined == 1


def test_trained_group_without_recorded_dispatch_maps_to_its_prompt_by_id():
    report = summarize([trained(1, "exp-x1-e0-p7-a2"), trained(2, "exp-x1-e0-p7-a3")])
    [p] = report.prompts
    assert (p.epoch, p.index, p.fate) == (0, 7, "trained_twice")


def test_quarantined_own_group_is_failed_with_the_reason_foreign_one_only_counted():
    events = [
        dispatched("g0", 0),
        settled("g0"),
        {"event": "quarantined", "group": "g0", "reason": "token id 999 >= vocab 64"},
        {"event": "quarantined", "group": "other-e0-p1-a0", "reason": "foreign experiment"},
    ]
    report = summarize(events)
    assert report.quarantined == 2 and len(report.prompts) == 1
    assert (report.prompts[0].fate, report.prompts[0].reason) == (
        "failed",
        "quarantined: token id 999 >= vocab 64",
    )


def test_dropped_then_requeued_but_never_dispatched_again_is_left_over():
    events = [
        dispatched("a0", 3),
        settled("a0"),
        {"event": "dropped", "group": "a0", "reason": "the trainer found it too stale"},
        {"event": "left_over", "prompts": [[0, 3]], "reason": "re-queued when the run ended"},
    ]
    assert summarize(events).totals["left_over"] == 1
    assert summarize(events[:3]).totals["lost"] == 1  # without the report it would be lost


def test_left_over_stored_before_the_dispatch_still_counts():
    # the trainer's report is stored while the scheduler's writer still holds the dispatch
    events = [
        {"event": "left_over", "groups": ["exp-e0-p5-a0"], "reason": "not trained when it ended"},
        dispatched("exp-e0-p5-a0", 5),
        settled("exp-e0-p5-a0"),
    ]
    report = summarize(events)
    assert report.totals["left_over"] == 1 and report.totals["lost"] == 0
    assert len(report.prompts) == 1


def test_quarantine_stored_before_the_settle_still_fails_the_group():
    events = [
        dispatched("g0", 0),
        {"event": "quarantined", "group": "g0", "reason": "a logprob is not finite"},
        settled("g0"),
    ]
    [p] = summarize(events).prompts
    assert (p.fate, p.reason) == ("failed", "quarantined: a logprob is not finite")


def test_trained_event_names_each_samples_versions_and_their_fingerprints():
    from asyncrl.ledger import sample_fingerprints
    from asyncrl.types import Sample, TrajectoryGroup

    fp3, fp4 = "sha256:" + "3" * 64, "sha256:" + "4" * 64
    keys = {"experiment_id": "e", "prompt_id": "p", "prompt": "1+1=", "answer": "2"}
    keys["prompt_ids"] = [1, 2]
    g0 = TrajectoryGroup(
        **keys,
        group_id="g0",
        samples=[Sample(versions=[3, 3, 4]), Sample(versions=[4])],  # updated mid-way
        fingerprints={3: fp3, 4: fp4},
    )
    g1 = TrajectoryGroup(**keys, group_id="g1", samples=[Sample(versions=[5])])
    fields = sample_fingerprints([g0, g1])
    assert fields == {
        "groups": ["g0", "g1"],
        "samples": {"g0": [{"3": 0, "4": 1}, {"4": 1}], "g1": [{"5": 2}]},
        "fingerprints": [fp3, fp4, ""],
    }
    events = [
        dispatched("g0", 0),
        settled("g0"),
        dispatched("g1", 1),
        settled("g1"),
        {"event": "trained", "step": 1, "version": 1, "run": "r", **fields},
    ]
    p0, p1 = summarize(events).prompts
    assert p0.samples == [{"3": fp3, "4": fp4}, {"4": fp4}]
    assert p1.samples == [{"5": ""}]


def test_trained_event_without_sample_fields_has_no_sample_rows():
    """A ledger written before the fields existed still reads."""
    p0 = summarize([dispatched("g0", 0), settled("g0"), trained(1, "g0")]).prompts[0]
    assert (p0.fate, p0.samples) == ("trained", [])


def test_resumed_run_takes_back_what_the_end_left_over():
    """A cancelled run left g1 (in flight) and p2 (re-queued) over, and the trainer g0
    (published, untrained); after `resumed` they are trained, or filtered: no longer left
    over. What the resumed run leaves over at its own end is."""
    events = [
        *(dispatched(f"g{i}", i) for i in range(4)),
        settled("g0"),
        {"event": "retried", "group": "g2", "reason": "rollout lost"},
        {"event": "left_over", "groups": ["g1"], "reason": "in flight when the run ended"},
        {"event": "left_over", "prompts": [[0, 2]], "reason": "re-queued when the run ended"},
        {"event": "left_over", "groups": ["g0"], "reason": "not trained when it ended"},
        {"event": "resumed", "state": "CANCELLED", "requeued": 2, "version": 0},
        dispatched("g1", 1),
        dispatched("g2", 2),
        settled("g1"),
        settled("g2", "rejected", "constant reward 0"),
        settled("g3"),
        trained(1, "g0", "g1"),
        {"event": "left_over", "groups": ["g3"], "reason": "not trained when it ended"},
    ]
    report = summarize(events)
    fates = {p.prompt: p.fate for p in report.prompts}
    assert fates == {"p0": "trained", "p1": "trained", "p2": "filtered", "p3": "left_over"}
    assert report.totals["lost"] == report.totals["trained_twice"] == 0


def test_unaccounted_the_latest_accepted_untrained_not_written_left_over():
    events = [dispatched(f"g{i}", i) for i in range(4)] + [settled(f"g{i}") for i in range(4)]
    events += [trained(1, "g0"), {"event": "left_over", "groups": ["g1"]}]
    report = summarize(events)
    assert report.totals["lost"] == 2  # g2, g3: accepted, trained by none, never written
    assert unaccounted(report, untrained=3) == ["g2", "g3"]  # g1 is written already
    assert unaccounted(report, untrained=2) == ["g3"]  # never more than the scheduler saw
    assert unaccounted(report, untrained=1) == []


def test_every_event_the_writers_make_is_well_formed():
    sample = {
        **trained(1, "g1"),
        "fingerprints": ["sha256:a"],
        "samples": {"g1": [{"1": 0}]},
    }
    events = [dispatched("g1", 0), settled("g1"), sample, {"event": "rewound", "to_step": 0}]
    events += [{"event": "left_over", "groups": ["g1"], "prompts": [[0, 1]]}]
    assert [well_formed(e) for e in events] == [True] * 5


@pytest.mark.parametrize(
    "event",
    [
        None,
        [],
        "trained",
        {"step": 1},  # no kind
        {"event": 3},
        {"event": "dispatched", "group": "g", "epoch": "0", "index": 0, "prompt": "p"},
        {"event": "dispatched", "group": "g", "epoch": True, "index": 0, "prompt": "p"},
        {"event": "settled", "group": "g"},  # no status
        {"event": "trained", "step": 1, "version": 1, "groups": [1]},
        {"event": "trained", "step": 1, "version": 1, "groups": [], "run": ["r"]},
        {
            "event": "trained",
            "step": 1,
            "version": 1,
            "groups": ["g"],
            "samples": {"g": [{"1": 2}]},
        },
        {"event": "rewound", "to_step": None},
        {"event": "left_over", "prompts": [[0]]},
        {"event": "rewound", "to_step": 1, "groups": None},  # make fuzz's: summarize raised
    ],
)
def test_a_malformed_event_is_not_well_formed(event):
    """read_events leaves such an event out (a writer's bug): `summarize` reads each kind's
    fields with these types, and the rest of the ledger still reads."""
    assert not well_formed(event)
