"""The scheduler's pure policy: admission under bounded staleness, stale aborts, assignment,
leases and eval accounting, with exact values (AReaL's reference numbers for capacity)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.scheduler.evaluation import MAX_EVAL_ATTEMPTS, EvalRound, Evaluator, eval_due
from services.scheduler.policy import (
    StalenessManager,
    least_loaded,
    must_abort,
)
from services.scheduler.records import GroupCounters, Progress
from services.scheduler.registry import Joined, Registry, WorkerKind


class FakeVersion:
    def __init__(self, v: int = 0):
        self.v = v

    def __call__(self) -> int:
        return self.v


def manager(max_concurrent=100, batch_size=4, eta=2, version=0):
    fv = FakeVersion(version)
    return StalenessManager(max_concurrent, batch_size, eta, fv), fv


@pytest.mark.parametrize(
    ("batch_size", "eta", "version", "expected"),
    [(4, 2, 0, 12), (4, 2, 5, 32), (8, 0, 0, 8), (8, 0, 5, 48)],
)
def test_capacity_reference_numbers_match_areal(batch_size, eta, version, expected):
    sm, _ = manager(100, batch_size, eta, version)
    assert sm.capacity() == expected


def test_capacity_max_concurrent_bounds_admission():
    sm, _ = manager(max_concurrent=5, batch_size=4, eta=2)
    assert sm.capacity() == 5
    for _ in range(3):
        sm.on_submit()
    assert sm.capacity() == 2


def test_capacity_counts_running_and_accepted_against_staleness_budget():
    sm, fv = manager(batch_size=4, eta=2)
    for _ in range(12):
        sm.on_submit()
    assert sm.capacity() == 0
    for _ in range(12):
        sm.on_accept()
    assert (sm.counts.running, sm.counts.accepted, sm.capacity()) == (0, 12, 0)
    fv.v = 1  # one more version -> one more batch
    assert sm.capacity() == 4


def test_capacity_rejected_and_failed_groups_free_their_slot():
    sm, _ = manager(batch_size=2, eta=0)
    sm.on_submit()
    sm.on_submit()
    assert sm.capacity() == 0
    sm.on_reject()
    sm.on_fail()
    assert (sm.capacity(), sm.counts.rejected, sm.counts.failed, sm.counts.running) == (2, 1, 1, 0)


def test_capacity_never_negative_after_version_rollback():
    sm, fv = manager(batch_size=4, eta=0, version=3)
    sm.load_counters(GroupCounters(accepted=12))
    fv.v = 1  # a trainer resumed from an older checkpoint
    assert sm.capacity() == 0


def test_abort_counts_as_drop_and_frees_capacity():
    sm, _ = manager(batch_size=4, eta=1)
    for _ in range(8):
        sm.on_submit()
    assert sm.capacity() == 0
    for _ in range(3):
        sm.on_abort()
    assert (sm.capacity(), sm.counts.stale_dropped, sm.counts.accepted, sm.counts.rejected) == (
        3,
        3,
        0,
        0,
    )


def test_trainer_drop_frees_accepted_capacity_so_run_never_deadlocks():
    # eta=1, B=2: 4 groups accepted at v0, the trainer drops 3 as too stale. Without freeing
    # capacity on a drop, drops + running > eta*B would block dispatch forever.
    sm, _ = manager(batch_size=2, eta=1)
    for _ in range(4):
        sm.on_submit()
        sm.on_accept()
    assert sm.capacity() == 0
    for _ in range(3):
        sm.on_trainer_drop()
    assert (sm.counts.accepted, sm.counts.stale_dropped, sm.capacity()) == (1, 3, 3)


def test_requeue_frees_slot_and_counts():
    sm, _ = manager(batch_size=2, eta=0)
    sm.on_submit()
    sm.on_requeue()
    assert (sm.counts.running, sm.counts.requeued, sm.capacity()) == (0, 1, 2)


def test_resume_keeps_persisted_accepted_whatever_the_trainer_version():
    # the fleet resumes at the trainer's version 5; the groups it trained are in `accepted`
    sm, _ = manager(batch_size=4, eta=2, version=5)
    sm.load_counters(Progress(accepted=22, running=3, version=5))
    assert (sm.counts.accepted, sm.counts.running) == (22, 0)
    assert sm.capacity() == 10  # (eta + 5 + 1) * B - 22, not a burst of 32


def test_load_counters_restores_outcomes_but_not_running():
    sm, _ = manager()
    saved = Progress(
        accepted=4, rejected=1, failed=2, stale_dropped=3, requeued=5, running=7, dispatched=6
    )
    sm.load_counters(saved)
    assert sm.counts == GroupCounters(
        accepted=4, rejected=1, failed=2, stale_dropped=3, requeued=5, running=0, dispatched=6
    )


def test_submit_counts_running_and_dispatched():
    sm, _ = manager()
    sm.on_submit()
    sm.on_reject()
    sm.on_submit()
    assert (sm.counts.running, sm.counts.dispatched, sm.counts.rejected) == (1, 2, 1)


def test_finish_without_submit_is_a_bug():
    sm, _ = manager()
    with pytest.raises(AssertionError):
        sm.on_accept()


@pytest.mark.parametrize(
    ("start", "new", "eta", "expected"),
    [
        (0, 1, 0, False),  # the step that produced v1 (trainer at v0) may have trained it
        (0, 2, 0, True),
        (0, 2, 1, False),
        (3, 6, 2, False),
        (3, 7, 2, True),
        (5, 5, 0, False),
    ],
)
def test_must_abort_only_when_even_the_committing_step_was_too_late(start, new, eta, expected):
    assert must_abort(start, new, eta) is expected


@dataclass(frozen=True)
class RolloutLoad:
    """A rollout's load as `least_loaded` reads it (a registry Worker has the same fields)."""

    worker_id: str
    running: int
    capacity: int


def pick_rollout(loads) -> str | None:
    """The id `least_loaded` picks, or None."""
    best = least_loaded(loads)
    return None if best is None else best.worker_id


def test_pick_rollout_least_loaded_ratio():
    loads = [RolloutLoad("b", 2, 4), RolloutLoad("a", 3, 4), RolloutLoad("c", 1, 1)]
    assert pick_rollout(loads) == "b"


def test_pick_rollout_ties_broken_by_id():
    assert pick_rollout([RolloutLoad("z", 1, 2), RolloutLoad("m", 2, 4)]) == "m"


def test_pick_rollout_none_when_all_full():
    assert pick_rollout([RolloutLoad("a", 2, 2), RolloutLoad("b", 1, 0)]) is None
    assert pick_rollout([]) is None


def test_least_loaded_registry_workers_returns_the_worker_pick_rollout_names():
    reg = Registry(clock=FakeClock())
    ws = [
        reg.register(WorkerKind.ROLLOUT, f"h:{i}", "", cap)[0] for i, cap in enumerate((4, 4, 1, 0))
    ]
    for w, running in zip(ws, (2, 1, 0, 1), strict=True):
        w.running = running
    loads = [RolloutLoad(w.worker_id, w.running, w.capacity) for w in ws]
    best = least_loaded(ws)
    assert best is ws[2]  # 0/1 beats 1/4 and 2/4; the full 1/max(1, 0) is skipped
    assert best.worker_id == pick_rollout(loads)
    ws[2].running = 1
    assert least_loaded(ws) is ws[1]
    assert least_loaded([ws[3]]) is None


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_registry_ids_prefixed_by_kind_and_heartbeat_renews_lease():
    clock = FakeClock()
    reg = Registry(lease_ttl_s=10, clock=clock)
    w, joined = reg.register(WorkerKind.ROLLOUT, "127.0.0.1:1", "r", 4)
    assert (
        joined is Joined.NEW
        and w.worker_id.startswith("rollout-")
        and len(w.worker_id) == len("rollout-") + 8
    )
    clock.t += 8
    assert reg.heartbeat(w.worker_id, load=2)
    clock.t += 8
    assert reg.expire() == []
    clock.t += 3
    assert [x.worker_id for x in reg.expire()] == [w.worker_id]
    assert reg.heartbeat(w.worker_id) is False


def test_registry_same_address_reregistration_keeps_id_and_binding():
    reg = Registry(clock=FakeClock())
    w, _ = reg.register(WorkerKind.ROLLOUT, "h:1", "r", 4)
    reg.bind(w, "exp")
    again, joined = reg.register(WorkerKind.ROLLOUT, "h:1", "r", 8)
    assert (again is w, joined, w.experiment_id, w.capacity) == (True, "restarted", "exp", 8)


def test_registry_fenced_worker_not_idle_until_cooldown_passes():
    clock = FakeClock()
    reg = Registry(lease_ttl_s=100, clock=clock)
    w, _ = reg.register(WorkerKind.ROLLOUT, "h:1", "r", 4)
    reg.bind(w, "exp")
    reg.unbind(w, cooldown_s=5)
    assert reg.idle(WorkerKind.ROLLOUT) == []
    clock.t += 5
    assert reg.idle(WorkerKind.ROLLOUT) == [w]


def test_registry_reward_addresses_lists_all_live_reward_workers():
    reg = Registry(clock=FakeClock())
    reg.register(WorkerKind.REWARD, "h:2", "", 1)
    reg.register(WorkerKind.REWARD, "h:3", "", 1)
    reg.register(WorkerKind.ROLLOUT, "h:4", "", 1)
    assert sorted(reg.reward_addresses()) == ["h:2", "h:3"]


def test_registry_workers_by_id_follow_joins_and_leases_lapsing():
    clock = FakeClock()
    reg = Registry(lease_ttl_s=10, clock=clock)
    a, _ = reg.register(WorkerKind.ROLLOUT, "h:1", "", 1)
    t, _ = reg.register(WorkerKind.TRAINER, "h:2", "", 1)
    assert reg.workers(WorkerKind.ROLLOUT) == [a]
    reg.workers(WorkerKind.ROLLOUT).clear()  # a copy: the registry's view is not changed
    clock.t += 6
    b, _ = reg.register(WorkerKind.ROLLOUT, "h:3", "", 1)
    assert reg.workers(WorkerKind.ROLLOUT) == sorted([a, b], key=lambda w: w.worker_id)
    assert reg.workers() == sorted([a, b, t], key=lambda w: w.worker_id)
    clock.t += 5  # a's and t's leases lapse, b's does not
    assert {w.worker_id for w in reg.expire()} == {a.worker_id, t.worker_id}
    assert reg.workers(WorkerKind.ROLLOUT) == [b] and reg.workers() == [b]
    assert reg.bound("exp", WorkerKind.ROLLOUT) == []
    reg.bind(b, "exp")
    assert reg.bound("exp", WorkerKind.ROLLOUT) == [b]


@pytest.mark.parametrize(
    ("version", "every", "start", "final", "expected"),
    [
        (0, 5, True, False, True),
        (5, 5, False, False, True),
        (6, 5, False, False, False),
        (7, 0, False, True, True),
        (5, 0, False, False, False),
    ],
)
def test_eval_due_at_start_every_k_and_end(version, every, start, final, expected):
    assert eval_due(version, every, start=start, final=final) is expected


def test_eval_round_accuracy_counts_failed_samples_as_wrong():
    r = EvalRound(version=3, n_prompts=2, n_samples=4)
    assert r.next() == (0, 0)
    assert r.next() == (1, 0)
    r.add([1.0, 0.0, 1.0], failed_samples=1, group_failed=False)  # one sample failed scoring
    assert not r.done
    r.add([1.0, 1.0, 0.5, 0.0], failed_samples=0, group_failed=False)
    assert r.done
    res = r.result()
    assert (res.version, res.n_prompts, res.n_samples, res.failed) == (3, 2, 8, 1)
    assert res.accuracy == pytest.approx(4 / 8)
    assert res.reward_mean == pytest.approx(4.5 / 7)


def test_eval_round_retries_then_counts_prompt_all_failed():
    r = EvalRound(version=0, n_prompts=1, n_samples=2)
    for attempt in range(MAX_EVAL_ATTEMPTS):
        assert r.next() == (0, attempt)
        r.retry(0, attempt)
    assert r.done
    res = r.result()
    assert (res.n_samples, res.failed, res.accuracy) == (2, 2, 0.0)


def test_eval_round_records_the_versions_that_generated_its_tokens():
    r = EvalRound(version=10, n_prompts=3, n_samples=1)
    for _ in range(3):
        r.next()
    r.add([1.0], 0, False, versions=(10, 10))
    r.add([0.0], 0, False, versions=(11, 13))  # the fleet moved on mid-generation
    r.add([], 1, True, versions=None)  # failed before any token
    res = r.result()
    assert (res.version, res.min_version, res.max_version) == (10, 10, 13)


def test_eval_round_without_tokens_reports_its_own_version():
    r = EvalRound(version=4, n_prompts=1, n_samples=2)
    r.next()
    r.add([], 2, True)
    res = r.result()
    assert (res.min_version, res.max_version) == (4, 4)


def test_evaluator_first_is_the_start_round_until_it_finishes():
    ev = Evaluator(n_prompts=1, every_versions=5, n_samples=1, done_versions=set())
    assert ev.schedule(0, start=True)
    first = ev.first
    assert first is not None and first.version == 0
    assert ev.schedule(5)  # a later round is never "first"
    assert ev.first is first
    round_, index, attempt = ev.next()
    assert round_ is first
    first.add([1.0], 0, False, versions=(0, 0))
    assert ev.samples == 1
    assert ev.pop_finished(first).max_version == 0
    assert ev.first is None and ev.samples == 0


def test_evaluator_resumed_after_earlier_evals_holds_nothing():
    ev = Evaluator(n_prompts=1, every_versions=5, n_samples=1, done_versions={0, 5})
    assert not ev.schedule(5, start=True)  # evaluated already
    assert ev.schedule(7, start=True)  # a resume's round at its version: not the baseline
    assert ev.first is None


def test_evaluator_trainer_restart_opens_no_second_baseline():
    ev = Evaluator(n_prompts=1, every_versions=5, n_samples=1, done_versions=set())
    assert ev.schedule(0, start=True)
    first = ev.first
    assert ev.schedule(3, start=True)  # the trainer came back at v3 while v0 ran
    assert ev.first is first and first.version == 0
