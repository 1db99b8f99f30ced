"""The slot division of a shared rollout fleet (policy.divide_slots) and the registry's
shared binding. Expected values computed by hand from the definition: every experiment gets
max(1, ...) slots, the rest total * share / sum(shares) floored, the leftover slots one each to
the largest fractional parts (Hamilton's largest-remainder method), ties to the older."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.scheduler.policy import divide_slots
from services.scheduler.registry import Registry, WorkerKind
from services.scheduler.sharing import bind_rollouts


@pytest.mark.parametrize(
    ("total", "shares", "expected"),
    [
        # 16 * 1/4 = 4, 16 * 1/4 = 4, 16 * 2/4 = 8: exact
        (16, {"a": 1.0, "b": 1.0, "c": 2.0}, {"a": 4, "b": 4, "c": 8}),
        # 16 / 3 = 5.33 each: floors 5+5+5 = 15, the one left to the oldest (a tie)
        (16, {"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 6, "b": 5, "c": 5}),
        # 16/3 = 5.33 and 32/3 = 10.67: floors 5+10, the one left to the larger remainder
        (16, {"a": 1.0, "b": 2.0}, {"a": 5, "b": 11}),
        # 10 / 4 = 2.5 each: floors 2 x 4 = 8, two left to the two oldest
        (10, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, {"a": 3, "b": 3, "c": 2, "d": 2}),
        # 4 * 1/102 = 0.04 < 1: a and b get 1 each (the minimum), c the 2 left
        (4, {"a": 1.0, "b": 1.0, "c": 100.0}, {"a": 1, "b": 1, "c": 2}),
        # fewer slots than experiments: 1 each all the same
        (2, {"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 1, "b": 1, "c": 1}),
        # one experiment: everything; 0.5 / 1.5 weights as 1:3 of 8 -> 2, 6
        (16, {"a": 3.0}, {"a": 16}),
        (8, {"a": 0.5, "b": 1.5}, {"a": 2, "b": 6}),
        (16, {}, {}),
    ],
)
def test_divide_slots_by_share_exact(total, shares, expected):
    assert divide_slots(total, shares) == expected


def test_divide_slots_sums_to_total_when_every_one_fits():
    shares = {"a": 0.3, "b": 1.7, "c": 2.9, "d": 0.1}
    for total in range(4, 64):
        quotas = divide_slots(total, shares)
        assert sum(quotas.values()) == total and min(quotas.values()) >= 1


def _rollout(registry: Registry):
    worker, _ = registry.register(WorkerKind.ROLLOUT, "127.0.0.1:1", "r", 8)
    return worker


def test_shared_rollout_serves_each_experiment_and_frees_when_the_last_leaves():
    now = [100.0]
    registry = Registry(clock=lambda: now[0])
    w = _rollout(registry)
    assert registry.share(w, "a") and registry.share(w, "b")
    assert registry.bound("a", WorkerKind.ROLLOUT) == [w] == registry.bound("b", WorkerKind.ROLLOUT)
    assert registry.idle(WorkerKind.ROLLOUT) == []
    registry.release(w, "a", cooldown_s=5.0)  # a fenced it: b keeps it
    assert w.shared == ["b"] and registry.bound("a", WorkerKind.ROLLOUT) == []
    assert not registry.share(w, "a")  # a may not share it again while it cools down
    now[0] += 5.1
    assert registry.share(w, "a") and w.shared == ["b", "a"]
    registry.release(w, "b")
    registry.release(w, "a")
    assert w.shared == [] and registry.idle(WorkerKind.ROLLOUT) == [w]


class _Runner:
    """What the binding reads of an experiment runner: its spec, id, age, rollouts, slots."""

    def __init__(self, registry: Registry, eid: str, created: int, lora: bool, share: float):
        self.registry, self.id = registry, eid
        self.record = SimpleNamespace(created_unix_ms=created)
        lora_spec = {"rank": 4} if lora else None
        self.spec = SimpleNamespace(
            trainer=SimpleNamespace(lora=lora_spec),
            model=SimpleNamespace(path="/base", tokenizer_path=None),
            rollout=SimpleNamespace(engine="torch"),
            share=share,
        )
        self.dispatcher = SimpleNamespace(slots=None)
        self.log = SimpleNamespace(info=lambda *a, **k: None)
        self.attached: list[str] = []

    def rollouts(self):
        return self.registry.bound(self.id, WorkerKind.ROLLOUT)

    def attach_rollout(self, worker) -> None:
        self.attached.append(worker.worker_id)

    def release_rollout(self, worker, reason: str, cooldown_s: float = 0.0) -> None:
        self.registry.release(worker, self.id, cooldown_s)


def test_bind_rollouts_pool_shares_its_replicas_beside_a_full_parameter_experiment():
    registry = Registry(clock=lambda: 100.0)
    for port in range(4):
        registry.register(WorkerKind.ROLLOUT, f"127.0.0.1:{port}", "r", 4)
    full = _Runner(registry, "full", 1, lora=False, share=1.0)
    a = _Runner(registry, "a", 2, lora=True, share=1.0)
    b = _Runner(registry, "b", 3, lora=True, share=3.0)
    log = SimpleNamespace(info=lambda *a, **k: None)
    bind_rollouts(registry, [full, a, b], log)
    # two units (full; the pool a+b) get 2 whole replicas each; a and b share both of theirs
    assert len(full.rollouts()) == 2 and all(w.experiment_id == "full" for w in full.rollouts())
    assert a.rollouts() == b.rollouts() and len(a.rollouts()) == 2
    assert all(w.shared == ["a", "b"] for w in a.rollouts())
    # the pool's 8 slots by share 1:3 -> 2, 6; the full-parameter one is not capped
    assert (full.dispatcher.slots, a.dispatcher.slots, b.dispatcher.slots) == (None, 2, 6)
    # c joins the pool: it shares the same replicas, the pool's slots are divided again
    c = _Runner(registry, "c", 4, lora=True, share=4.0)
    bind_rollouts(registry, [full, a, b, c], log)
    assert c.rollouts() == a.rollouts() and sorted(c.attached) == sorted(
        w.worker_id for w in a.rollouts()
    )
    assert (a.dispatcher.slots, b.dispatcher.slots, c.dispatcher.slots) == (1, 3, 4)
    # b ends: it lets go of its replicas, a and c keep them, and take its slots
    for w in b.rollouts():
        b.release_rollout(w, "ended")
    bind_rollouts(registry, [full, a, c], log)
    assert b.rollouts() == [] and all(w.shared == ["a", "c"] for w in a.rollouts())
    assert (a.dispatcher.slots, c.dispatcher.slots) == (2, 6)  # 8 * 1/5 = 1.6, 8 * 4/5 = 6.4
    assert len(full.rollouts()) == 2  # the full-parameter experiment kept its replicas
