"""`Registry.bound` answers from an index by experiment; every change of who serves whom (a
worker joining, leaving or expiring; bind, unbind, share, release) shows in the next answer,
the same as a scan of every worker would give."""

from __future__ import annotations

from services.scheduler.registry import Registry, WorkerKind

ROLLOUT, REWARD = WorkerKind.ROLLOUT, WorkerKind.REWARD


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def names(workers) -> list[str]:
    return [w.name for w in workers]


def test_every_change_shows_in_the_next_answer():
    clock = Clock()
    reg = Registry(lease_ttl_s=10.0, clock=clock)
    a, _ = reg.register(ROLLOUT, "h:1", "a", 4)
    b, _ = reg.register(ROLLOUT, "h:2", "b", 4)
    assert reg.bound("x", ROLLOUT) == []
    reg.bind(a, "x")
    assert names(reg.bound("x", ROLLOUT)) == ["a"] and reg.bound("y", ROLLOUT) == []
    reg.share(b, "x")
    reg.share(b, "y")
    assert sorted(names(reg.bound("x", ROLLOUT))) == ["a", "b"]
    assert names(reg.bound("y", ROLLOUT)) == ["b"]
    reg.release(b, "x")
    assert names(reg.bound("x", ROLLOUT)) == ["a"] and names(reg.bound("y", ROLLOUT)) == ["b"]
    reg.unbind(a)
    assert reg.bound("x", ROLLOUT) == []
    c, _ = reg.register(ROLLOUT, "h:3", "c", 4)
    reg.bind(c, "x")
    assert names(reg.bound("x", ROLLOUT)) == ["c"] and reg.bound("x", REWARD) == []
    reg.remove(c.worker_id)
    assert reg.bound("x", ROLLOUT) == []
    reg.bind(a, "x")
    clock.t += 11.0  # every lease lapses
    reg.heartbeat(b.worker_id)
    assert names(reg.expire()) == ["a"] and reg.bound("x", ROLLOUT) == []


def test_the_answer_is_a_new_list_each_call():
    reg = Registry(lease_ttl_s=10.0)
    a, _ = reg.register(ROLLOUT, "h:1", "a", 4)
    reg.bind(a, "x")
    first = reg.bound("x", ROLLOUT)
    first.clear()
    assert names(reg.bound("x", ROLLOUT)) == ["a"]
