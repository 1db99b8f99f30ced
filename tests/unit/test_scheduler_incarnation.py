"""A worker's incarnation and lease key (services/scheduler/registry.py, asyncrl.liveness):
registering again from the same process changes nothing, another process at the address is a
restart, and a heartbeat renews a lease only with that incarnation's lease key."""

from __future__ import annotations

from asyncrl.liveness import Beat
from services.scheduler.registry import BeatResult, Joined, Registry, WorkerKind


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def registry(lease: float = 10.0) -> tuple[Registry, Clock]:
    clock = Clock()
    return Registry(lease_ttl_s=lease, clock=clock), clock


def test_same_incarnation_registers_again_without_a_new_key():
    reg, _ = registry()
    w, first = reg.register(WorkerKind.ROLLOUT, "h:1", "r", 4, incarnation="aa")
    key = w.lease_key
    reg.bind(w, "exp")
    again, joined = reg.register(WorkerKind.ROLLOUT, "h:1", "r", 4, incarnation="aa")
    assert (first, joined, again is w, w.lease_key, w.experiment_id) == (
        Joined.NEW, Joined.AGAIN, True, key, "exp"
    )  # fmt: skip


def test_another_incarnation_is_a_restart_with_a_new_key():
    reg, _ = registry()
    w, _ = reg.register(WorkerKind.ROLLOUT, "h:1", "r", 4, incarnation="aa")
    old_key = w.lease_key
    _, joined = reg.register(WorkerKind.ROLLOUT, "h:1", "r", 4, incarnation="bb")
    assert (joined, w.incarnation, w.lease_key != old_key, len(w.lease_key)) == (
        Joined.RESTARTED, "bb", True, 32
    )  # fmt: skip


def test_a_worker_without_incarnation_is_taken_for_a_restart_each_time():
    reg, _ = registry()
    reg.register(WorkerKind.TRAINER, "h:1", "t", 1)
    _, joined = reg.register(WorkerKind.TRAINER, "h:1", "t", 1)
    assert joined is Joined.RESTARTED


def test_a_late_beat_of_the_replaced_process_renews_nothing():
    reg, clock = registry(lease=10.0)
    w, _ = reg.register(WorkerKind.ROLLOUT, "h:1", "r", 4, incarnation="aa")
    old_key = w.lease_key
    reg.register(WorkerKind.ROLLOUT, "h:1", "r", 4, incarnation="bb")
    clock.t += 9
    assert reg.beat(w.worker_id, "aa", old_key, 3) is BeatResult.STALE
    assert reg.beat(w.worker_id, "bb", old_key, 3) is BeatResult.STALE  # the old key
    clock.t += 2  # 11 s after the last renewal: the stale beats renewed nothing
    assert [x.worker_id for x in reg.expire()] == [w.worker_id]


def test_a_beat_with_its_key_renews_the_lease_and_sets_the_load():
    reg, clock = registry(lease=10.0)
    w, _ = reg.register(WorkerKind.REWARD, "h:2", "w", 1, incarnation="cc")
    clock.t += 9
    assert reg.beat(w.worker_id, "cc", w.lease_key, 7) is BeatResult.RENEWED
    clock.t += 9
    assert (reg.expire(), w.load) == ([], 7)
    assert reg.beat("reward-00000000", "cc", w.lease_key, 0) is BeatResult.UNKNOWN


def test_an_expired_address_registers_new_under_another_id():
    reg, clock = registry(lease=10.0)
    w, _ = reg.register(WorkerKind.ROLLOUT, "h:1", "r", 4, incarnation="aa")
    clock.t += 11
    reg.expire()
    again, joined = reg.register(WorkerKind.ROLLOUT, "h:1", "r", 4, incarnation="aa")
    assert (joined, again.worker_id != w.worker_id, reg.at(WorkerKind.ROLLOUT, "h:1")) == (
        Joined.NEW, True, again
    )  # fmt: skip


def test_a_beat_round_trips_and_garbage_is_no_beat():
    beat = Beat("rollout-0a1b2c3d", "9f" * 8, "ab" * 16, 3, 1700000000.125)
    assert Beat.decode(beat.encode()) == beat
    assert Beat.decode(b"rollout-1 aa key notanumber 1.0") is None
    assert Beat.decode(b"\xff\xfe a b 1 2") is None
    assert Beat.decode(b"too few fields") is None


def test_a_stalled_sweep_expires_no_one_the_next_does():
    from services.scheduler.liveness import StallGuard

    clock = Clock()
    guard = StallGuard(1.0, clock)
    clock.t += 1.2
    first = guard.stalled()
    clock.t += 3.5  # the loop was blocked
    second = guard.stalled()
    clock.t += 1.0
    assert (first, second, guard.stalled()) == (False, True, False)
