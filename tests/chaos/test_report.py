"""The chaos suite's pure parts: fault points, the report rows and the verdict (no cluster)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.chaos import report, scenarios_bcast
from tests.chaos.__main__ import parse_args, plan
from tests.chaos.scenarios import SCENARIOS, run_rng, targets
from tests.chaos.scenarios_ck import _rewound_in_log
from tests.chaos.scenarios_tenants import recovered_at

TIMELINE = [(0.0, 0), (4.0, 3), (9.5, 4), (10.0, 6)]
LEDGER = {
    "totals": {"trained": 24, "trained_twice": 0, "filtered": 0, "failed": 0, "lost": 0},
    "steps": 6,
    "trained_groups": 24,
    "quarantined": 0,
    "duplicates": 1,
}


def run_record(**extra) -> dict:
    faults = [
        {"what": "kill -9 trainer", "at_version": 3, "at_s": 5.0},
        {"what": "kill -9 trainer", "at_version": 4, "at_s": 9.6},
    ]
    return {"run": "trainer", "fault": "kill -9 trainer x2", "batch_size": 4} | {
        "faults": faults,
        "timeline": TIMELINE,
        **extra,
    }


def test_recovery_s_fault_then_higher_version_time_to_it():
    assert report.recovery_s(TIMELINE, {"at_s": 5.0, "at_version": 3}) == 4.5


def test_recovery_s_no_higher_version_after_fault_none():
    assert report.recovery_s(TIMELINE, {"at_s": 10.5, "at_version": 6}) is None


def test_recovery_s_rewound_and_in_flight_commit_counts_only_new_progress():
    """Killed at v3 (6.5s), v4 lands in flight, back at 7.5s, rewound to v0, past v4 at 28.3s."""
    timeline = [(0.0, 0), (6.4, 3), (6.7, 4), (25.2, 0), (27.8, 2), (28.0, 4), (28.3, 7)]
    fault = {"at_s": 6.5, "at_version": 3, "back_s": 1.0}
    assert report.recovery_s(timeline, fault) == 21.8
    assert report.lowest_after(timeline, fault) == 0


def test_make_row_ledger_and_status_counts_and_slowest_recovery():
    row = report.make_row(run_record(), LEDGER, {"state": "EXPERIMENT_STATE_COMPLETED"})
    assert row["completed"] and row["state"] == "COMPLETED"
    assert (row["at_version"], row["steps"], row["lost"], row["trained_twice"]) == (3, 6, 0, 0)
    assert [f["recovery_s"] for f in row["faults"]] == [4.5, 0.4]
    assert [f["lowest_after"] for f in row["faults"]] == [4, 6]
    assert row["recovery_s"] == 4.5
    assert row["expected_groups"] == 24 and row["duplicates"] == 1
    assert "timeline" not in row
    assert report.problems(row) == []


def test_problems_lost_twice_failed_infrastructure_fault_each_named():
    ledger = LEDGER | {"totals": LEDGER["totals"] | {"lost": 2, "trained_twice": 1, "failed": 3}}
    row = report.make_row(run_record(), ledger, {"state": "EXPERIMENT_STATE_COMPLETED"})
    assert report.problems(row) == ["lost=2", "trained_twice=1", "failed=3"]


def test_problems_poison_failed_allowed_quarantine_and_replay_short_named():
    ledger = LEDGER | {"totals": LEDGER["totals"] | {"failed": 1}, "quarantined": 2}
    record = run_record(infrastructure=False, expect_quarantined=3, expect_replayed=1)
    status = {"state": "EXPERIMENT_STATE_COMPLETED", "history": [{"replayed": 0}]}
    row = report.make_row(record, ledger, status)
    assert report.problems(row) == ["quarantined 2 < 3", "replayed 0 < 1"]
    status["history"].append({"replayed": 1})
    ledger["quarantined"] = 3
    assert report.problems(report.make_row(record, ledger, status)) == []


def test_problems_running_and_groups_not_steps_times_b_named():
    row = report.make_row(
        run_record(error="hung"),
        LEDGER | {"trained_groups": 25},
        {"state": "EXPERIMENT_STATE_RUNNING", "message": ""},
    )
    assert report.problems(row) == ["ended RUNNING:", "trained_groups 25 != 24", "hung"]


def test_targets_same_seed_same_versions_in_range_increasing():
    drawn = targets(run_rng(0, "trainer"), 3, 30)
    assert drawn == targets(run_rng(0, "trainer"), 3, 30)
    assert drawn == sorted(drawn) and all(2 <= v <= 26 for v in drawn)
    assert len(drawn) == 3


def test_plan_only_and_repeat_names_runs_and_seeds():
    runs = plan(parse_args(["--only", "trainer,poison", "--repeat", "2", "--seed", "5"]))
    assert runs == [
        ("trainer-1", "trainer", 5),
        ("trainer-2", "trainer", 6),
        ("poison-1", "poison", 5),
        ("poison-2", "poison", 6),
    ]


def test_plan_unknown_scenario_exits():
    with pytest.raises(SystemExit):
        plan(parse_args(["--only", "nope"]))


def test_scenarios_every_fault_of_the_suite_present():
    assert set(SCENARIOS) == {
        *("rollout", "reward", "trainer", "scheduler", "nats"),
        *("stop-rollout", "stop-trainer", "lost-reply", "poison"),
        "hung-reward",
        *("corrupt-checkpoint", "deep-rewind"),
        *("disk-full", "sigterm-reward", "sigterm-rollout", "sigterm-scheduler"),
        "sigterm-reward-pool",
        *("power-cut", "full-restart"),
        "tenants",
        "standby-scheduler",
        *("broadcast-rollout", "broadcast-trainer"),
        *("broadcast-shm-rollout", "broadcast-shm-trainer"),
    }


def test_standby_scheduler_run_dials_both_schedulers_judged_at_10s():
    standby = SCENARIOS["standby-scheduler"]
    assert standby.env == {
        "ASYNCRL_SCHEDULER_STANDBY": "1",
        "ASYNCRL_SCHEDULER": "127.0.0.1:50051,127.0.0.1:50052",
    }
    assert (standby.max_stall_s, standby.count) == (10.0, 3)


def test_tenants_stall_window_ends_at_the_recovery_point_itself():
    """bcorp-1 around the scheduler kill of a `tenants` run (2026-11-26): back 1.01 s after the
    kill (48.611), the first version past v13 after that is v15 at 54.054; the stall is that
    point minus the last change before the kill, 54.054 - 47.518 = 6.536. (The rounded
    recovery, 54.054 - 47.601 = 6.453 -> 6.45, would end the window at 54.051, before the
    point: no gap at all.)"""
    timeline = [(46.757, 11), (47.011, 12), (47.518, 13), (54.054, 15), (54.338, 16)]
    fault = {"at_s": 47.601, "at_version": 13, "back_s": 1.01}
    assert recovered_at(timeline, fault) == 54.054
    assert report.stall_s(timeline, fault | {"done_s": 54.054}) == 6.54
    assert report.recovery_s(timeline, fault) == 6.45
    assert recovered_at(timeline[:3], fault) is None


def test_hung_reward_row_judged_by_its_failed_prompts_reasons():
    expected = ["timed out after 5s", "not scored before the call's deadline"]
    ok = {"completed": True, "steps": 3, "trained_groups": 12, "expected_groups": 12}
    ok |= {"failed": 2, "infrastructure": False}
    ok |= {"expect_failed_reasons": expected}
    reasons = ["all 8 samples failed: timed out after 5s"]
    assert report.problems(ok | {"failed_reasons": reasons}) == []
    other = ["all 8 samples failed: ValueError: x"]
    assert report.problems(ok | {"failed_reasons": [*reasons, *other]}) == [
        f"a failed prompt's reason is none of {expected}: {[*reasons, *other]}"
    ]
    assert report.problems(ok | {"failed": 0, "failed_reasons": []}) == [
        f"no prompt failed with {expected}"
    ]


def test_stall_s_longest_gap_between_versions_from_before_the_fault_to_its_end():
    """Versions at 4.0 and 4.3 s, the fault at 4.5 s, then 5.0, 7.5 (the gap 5.0 -> 7.5 is the
    stall: 2.5 s), 7.8; done at 7.8 s; the gap 7.8 -> 20.0 comes after the fault's end."""
    timeline = [(4.0, 3), (4.3, 4), (5.0, 5), (7.5, 6), (7.8, 7), (20.0, 8)]
    fault = {"at_s": 4.5, "at_version": 4, "done_s": 7.8}
    assert report.stall_s(timeline, fault) == 2.5


def test_stall_s_without_done_s_ends_at_the_recovery_and_counts_the_gap_over_the_fault():
    """No done_s: the window ends at the recovery (v4 passed at 9.5 s); the stall is the gap
    from the last version before the fault (4.0 s) to it: 5.5 s."""
    assert report.stall_s(TIMELINE, {"at_s": 5.0, "at_version": 3}) == 5.5
    assert report.stall_s(TIMELINE, {"at_s": 10.5, "at_version": 6}) is None


def test_stall_s_run_ended_before_the_fault_did_window_ends_with_the_run():
    """The old process still draining when the run completed: no recovery (back_s past the
    end), the window runs to the last version (10.0 s): gaps 4.0 -> 9.5 -> 10.0."""
    fault = {"at_s": 5.0, "at_version": 3, "back_s": 30.0}
    assert report.stall_s(TIMELINE, fault) == 5.5


def test_problems_a_stall_over_the_scenarios_limit_fails_the_run():
    ok = {"completed": True, "steps": 3, "trained_groups": 12, "expected_groups": 12}
    assert report.problems(ok | {"max_stall_s": 2.0, "stall_s": 1.99}) == []
    assert report.problems(ok | {"max_stall_s": 2.0, "stall_s": 2.01}) == ["stalled 2.01 s > 2.0 s"]
    assert report.problems(ok | {"max_stall_s": 2.0, "stall_s": None}) == [
        "no stall measured (no fault followed by progress)"
    ]
    assert report.problems(ok | {"stall_s": 30.0}) == []  # not judged without a limit


def test_sigterm_scenarios_judged_by_a_stall_of_at_most_2s_over_more_steps():
    steps = {"sigterm-reward": 120, "sigterm-rollout": 400, "sigterm-scheduler": 120}
    for name, n in steps.items():
        assert (SCENARIOS[name].max_stall_s, SCENARIOS[name].steps) == (2.0, n)


def test_deep_rewind_counts_the_versions_the_trainer_threw_away_from_its_log(tmp_path):
    """The deep-rewind run of 2026-11-27: steps of 0.06 s, the kill after v16, the first poll
    after the restart at v11. The log says 16 -> 8, the timeline would say 4."""

    def line(event, **fields):
        return json.dumps({"event": event, "service": "trainer", **fields})

    lines = [line("experiment_started", version=0, resumed=False)]
    lines += [line("train_step", step=v, version=v) for v in range(1, 17)]
    lines += ["not json", line("experiment_started", version=8, resumed=True)]
    lines += [line("train_step", step=v, version=v) for v in range(9, 31)]
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "trainer-0.log").write_text("\n".join(lines) + "\n")
    assert _rewound_in_log(SimpleNamespace(cfg=SimpleNamespace(var=tmp_path))) == 8


def _line(event: str, second: int, **fields) -> dict:
    return {"event": event, "timestamp": f"2026-12-06T21:00:{second:02d}.000000Z", **fields}


def test_broadcast_stream_end_the_killed_trainers_lines_only():
    """v7 sent by a trainer before a rewind (second 1), then the killed trainer's v7 never
    finished (killed at second 30): only lines in [after, before) count."""
    log = [_line("broadcast_sent", 1, version=7), _line("broadcast_failed", 20, version=8)]
    t = scenarios_bcast.at(_line("x", 30))
    assert scenarios_bcast.stream_end(log, 7, t - 5, t) == ""
    assert scenarios_bcast.stream_end(log, 7) == "broadcast_sent"
    assert scenarios_bcast.stream_end(log, 8, t - 15, t) == "broadcast_failed"


def test_broadcast_samples_of_weights_nobody_committed_are_named():
    scheduler = [
        _line("version_committed", 1, version=3, fingerprint="xxh3:a"),
        _line("version_committed", 9, version=3, fingerprint="xxh3:b"),  # after a rewind
        _line("version_committed", 2, version=4, fingerprint="xxh3:c"),
    ]
    committed = scenarios_bcast.committed(scheduler)
    assert committed == {3: {"xxh3:a", "xxh3:b"}, 4: {"xxh3:c"}}
    samples = [{"0": "sha256:base", "3": "xxh3:b"}, {"4": "xxh3:c"}, {"4": "xxh3:partial"}]
    ledger = {"prompts": [{"fate": "trained", "epoch": 0, "index": 5, "samples": samples}]}
    ledger["prompts"].append({"fate": "filtered", "epoch": 0, "index": 6, "samples": samples})
    assert scenarios_bcast.uncommitted_samples(ledger, committed) == ["e0 p5 s2 v4 xxh3:partial"]
    samples[0]["3"] = ""
    assert scenarios_bcast.uncommitted_samples(ledger, committed)[0] == "e0 p5 s0 v3 unverified"


def test_broadcast_how_a_rollout_took_the_version_in_flight():
    log = [
        _line("weights_updated", 1, version=5),
        _line("broadcast_not_taken", 11, version=5, reason="RuntimeError: Connection closed"),
        _line("weights_updated", 12, version=5),
        _line("weights_streamed", 14, version=6),
    ]
    since = scenarios_bcast.at(_line("x", 10))
    assert scenarios_bcast.took(log, 5, since) == {
        "not_taken": "RuntimeError: Connection closed",
        "updated": "",
    }
    assert scenarios_bcast.took(log, 6, since) == {"streamed": ""}


def test_broadcast_a_stream_broken_on_the_wire_told_from_one_broken_before_it():
    wire = "RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read"
    assert scenarios_bcast.in_stream({"not_taken": wire, "updated": ""})
    assert not scenarios_bcast.in_stream({"not_taken": "DistNetworkError: Connection reset"})
    assert not scenarios_bcast.in_stream({"streamed": "", "updated": ""})
