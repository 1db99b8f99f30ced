"""The slot division of a shared rollout fleet (policy.divide_slots) and the registry's
shared binding. Expected values computed by hand from the definition: every experiment gets
max(1, ...) slots, the rest total * share / sum(shares) floored, the leftover slots one each to
the largest fractional parts (Hamilton's largest-remainder method), ties to the older."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.scheduler.policy import divide_slots
from services.scheduler.registry import Registry, WorkerKind
from services.scheduler.sharing import bind_rollouts, rebalance, reward_slices


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
    # two units by weight, full 1 : the pool's mean share (1 + 3) / 2 = 2 -> 4 * 1/3 = 1.33 and
    # 4 * 2/3 = 2.67: floors 1 + 2, the one left to the larger remainder (the pool): 1, 3
    assert len(full.rollouts()) == 1 and all(w.experiment_id == "full" for w in full.rollouts())
    assert a.rollouts() == b.rollouts() and len(a.rollouts()) == 3
    assert all(w.shared == ["a", "b"] for w in a.rollouts())
    # the pool's 12 slots by share 1:3 -> 3, 9; the full-parameter one is not capped
    assert (full.dispatcher.slots, a.dispatcher.slots, b.dispatcher.slots) == (None, 3, 9)
    # c joins the pool: it shares the same replicas, the pool's slots are divided again
    c = _Runner(registry, "c", 4, lora=True, share=4.0)
    bind_rollouts(registry, [full, a, b, c], log)
    assert c.rollouts() == a.rollouts() and sorted(c.attached) == sorted(
        w.worker_id for w in a.rollouts()
    )
    # 12 * 1/8 = 1.5, 12 * 3/8 = 4.5, 12 * 4/8 = 6: floors 1 + 4 + 6, the one left to a (tie)
    assert (a.dispatcher.slots, b.dispatcher.slots, c.dispatcher.slots) == (2, 4, 6)
    # b ends: it lets go of its replicas, a and c keep them, and take its slots
    for w in b.rollouts():
        b.release_rollout(w, "ended")
    bind_rollouts(registry, [full, a, c], log)
    assert b.rollouts() == [] and all(w.shared == ["a", "c"] for w in a.rollouts())
    assert (a.dispatcher.slots, c.dispatcher.slots) == (2, 10)  # 12/5 = 2.4, 48/5 = 9.6
    assert len(full.rollouts()) == 1  # the weights 1 : 2.5 keep 1 : 3


def _full(registry: Registry, n: int, share: float = 1.0) -> _Runner:
    return _Runner(registry, f"e{n}", n, lora=False, share=share)


def _rollouts(registry: Registry, count: int, first_port: int = 0) -> None:
    for port in range(first_port, first_port + count):
        registry.register(WorkerKind.ROLLOUT, f"127.0.0.1:{port}", "r", 4)


LOG = SimpleNamespace(info=lambda *a, **k: None)


def test_idle_rollouts_spread_by_share_not_to_the_first_experiment():
    registry = Registry(clock=lambda: 100.0)
    _rollouts(registry, 10)
    first = _full(registry, 1)
    bind_rollouts(registry, [first], LOG)
    assert len(first.rollouts()) == 10  # alone: all of them
    second, third = _full(registry, 2, share=2.0), _full(registry, 3, share=1.0)
    bind_rollouts(registry, [first, second, third], LOG)
    # 10 by 1:2:1 -> 2.5, 5, 2.5: floors 2 + 5 + 2, the one left to the older tie (first)
    assert [len(r.rollouts()) for r in (first, second, third)] == [3, 5, 2]
    bind_rollouts(registry, [first, second, third], LOG)  # stable: no more moves
    assert [len(r.rollouts()) for r in (first, second, third)] == [3, 5, 2]
    for w in second.rollouts():  # second ends
        second.release_rollout(w, "ended")
    bind_rollouts(registry, [first, third], LOG)
    assert [len(r.rollouts()) for r in (first, third)] == [5, 5]


@pytest.mark.parametrize(
    ("counts", "targets", "moves"),
    [
        ({"a": 10, "b": 0, "c": 0}, {"a": 4, "b": 3, "c": 3}, [("a", "b")] * 3 + [("a", "c")] * 3),
        # b is furthest above its target: it gives first; then a and b tie: the later (b)
        ({"a": 5, "b": 6, "c": 0}, {"a": 4, "b": 4, "c": 3}, [("b", "c"), ("b", "c"), ("a", "c")]),
        ({"a": 3, "b": 3}, {"a": 3, "b": 3}, []),
        # fewer rollouts than units: a unit never gives below its target of 1
        ({"a": 1, "b": 0, "c": 0}, {"a": 1, "b": 1, "c": 1}, []),
        ({"a": 2, "b": 0, "c": 0}, {"a": 1, "b": 1, "c": 1}, [("a", "b")]),
    ],
)
def test_rebalance_moves_exact(counts, targets, moves):
    assert rebalance(counts, targets) == moves


@pytest.mark.parametrize(
    ("addresses", "shares", "expected"),
    [
        # 6 by 1:2 -> 2, 4, consecutive
        (list("abcdef"), {"x": 1.0, "y": 2.0}, {"x": ["a", "b"], "y": ["c", "d", "e", "f"]}),
        # 5 by 1:1:1 -> 1.67 each: floors 1+1+1, two left to the oldest ties: 2, 2, 1
        (
            list("abcde"),
            {"x": 1.0, "y": 1.0, "z": 1.0},
            {"x": ["a", "b"], "y": ["c", "d"], "z": ["e"]},
        ),
        # fewer workers than experiments: one each, wrapping around
        (list("ab"), {"x": 1.0, "y": 1.0, "z": 1.0}, {"x": ["a"], "y": ["b"], "z": ["a"]}),
        ([], {"x": 1.0}, {"x": []}),
    ],
)
def test_reward_slices_exact(addresses, shares, expected):
    assert reward_slices(addresses, shares) == expected
