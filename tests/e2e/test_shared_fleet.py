"""Issue 25 acceptance 2: three LoRA experiments on one base run at once on two shared rollout
replicas, each with its own trainer (`make scale SERVICE=trainer N=3`), with `share` 1:1:2.
All three run together until each has dispatched WINDOW groups, then are cancelled with their
ledgers clean; while all three ran each held its weight's part of the fleet's group slots (docs/lora.md, "Sharing a fleet"), measured from the ledger:
a training group holds a slot from its `dispatched` event to the event that ends it."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.client import AsyncrlClient, is_terminal, state_name
from asyncrl.ledger import read_events
from asyncrl.natsutil import connect
from tests.cluster import Cluster, wait_for
from tests.e2e.experiment import (
    _settled_ledger,
    log_events,
    small_spec,
)

pytestmark = pytest.mark.timeout(600)

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
CAPACITY = 4
"""Group slots per rollout replica: 2 x 4 = 8 slots, divided 2 / 2 / 4 by shares 1:1:2."""
SHARES = (1.0, 1.0, 2.0)
SLOTS = (2, 2, 4)
"""Each experiment's part of the fleet's 8 slots at those shares."""
BATCH = 8
"""Groups per step, well above a share's slots: each experiment always has work waiting."""
WINDOW = 80
"""Groups each experiment dispatches while all three run (10 of its steps for the smallest
share) before all three are cancelled and their ledgers read."""
ENDS = ("settled", "dropped", "retried", "left_over")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("var"))
    c.env["ASYNCRL_ROLLOUT_ENGINE"] = "torch"
    c.env["ASYNCRL_ROLLOUT_ARGS"] = f"--capacity {CAPACITY}"
    try:
        started = c.sup("start", "--timeout", "240", timeout=300)
        assert started.returncode == 0, started.stdout + started.stderr
        for service, n in (("rollout", "2"), ("trainer", "3")):  # make scale SERVICE= N=
            scaled = c.sup("scale", service, n, "--timeout", "120")
            assert scaled.returncode == 0, scaled.stdout + scaled.stderr
        c.state()
        yield c
    finally:
        c.kill_all()


def shared_spec(task, name: str, share: float) -> dict:
    spec = small_spec(task, lr=1e-2, lora=LORA, batch_size=BATCH, total_steps=100_000)
    spec["name"], spec["share"] = name, share
    spec["rollout"] |= {"max_head_offpolicyness": 2, "max_concurrent_rollouts": 16}
    spec["rollout"]["gconfig"] |= {"max_new_tokens": 16, "ignore_eos": True}
    spec["eval"]["every_versions"] = 0
    return spec


def most_held(events: list[dict], start: float, end: float) -> int:
    """The most training groups the experiment held at once within [start, end] (a group
    holds a slot from its `dispatched` event to the event that ended it)."""
    open_, most = set(), 0
    for e in events:
        if e["event"] == "dispatched":
            open_.add(e["group"])
            if start <= e["t"] <= end:
                most = max(most, len(open_))
        elif e["event"] in ENDS:
            open_ -= set([e["group"]] if "group" in e else e.get("groups", []))
    return most


def slot_seconds(events: list[dict], start: float, end: float) -> float:
    """Seconds of slot held by the experiment's training groups within [start, end]: each
    from its `dispatched` event to the event that ended it (settled, dropped, retried, left
    over; still open at `end`: to `end`)."""
    opened: dict[str, float] = {}
    held = 0.0
    for e in events:
        if e["event"] == "dispatched":
            opened[e["group"]] = e["t"]
        elif e["event"] in ENDS:
            for group in [e["group"]] if "group" in e else e.get("groups", []):
                if group in opened:
                    t0 = opened.pop(group)
                    held += max(0.0, min(e["t"], end) - max(t0, start))
    return held + sum(max(0.0, end - max(t0, start)) for t0 in opened.values())


async def _ledgers(cluster: Cluster, ids: list[str]) -> list[list[dict]]:
    nc = await connect(f"nats://127.0.0.1:{cluster.nats_port}")
    try:
        return [await read_events(nc.jetstream(), i) for i in ids]
    finally:
        await nc.close()


def overlap(ledgers: list[list[dict]]) -> tuple[float, list[int]]:
    """When the last of the experiments dispatched its first group, and how many groups each
    dispatched from then on (None when one has not started yet)."""
    dispatched = [[e["t"] for e in events if e["event"] == "dispatched"] for events in ledgers]
    if not all(dispatched):
        return 0.0, [0] * len(ledgers)
    start = max(ts[0] for ts in dispatched)
    return start, [sum(t >= start for t in ts) for ts in dispatched]


def slots_divided(cluster: Cluster, experiment_id: str) -> list[tuple[int, int]]:
    """(slots, of) each time the scheduler divided the fleet's slots, for one experiment."""
    divided = log_events(cluster.var / "log" / "scheduler-0.log", "slots_divided")
    return [(e["slots"], e["of"]) for e in divided if e["experiment"] == experiment_id]


def rebalanced(cluster: Cluster, experiment_id: str, share_slots: int) -> bool:
    got = slots_divided(cluster, experiment_id)
    return bool(got) and got[-1][0] > share_slots


async def run_together(cluster: Cluster, specs: list[dict]) -> tuple[list, float, float]:
    """Submit every spec, let all of them run together until each has dispatched WINDOW
    groups, then cancel them: (the experiments, the window's start, its end). The window is
    made, not hoped for: the experiments run until cancelled, however far apart their
    trainers start and however fast the machine (a fixed length left no overlap at all once,
    when one experiment's trainer bound after another had finished)."""
    async with AsyncrlClient(cluster.scheduler) as client:
        ids = [(await client.submit(s)).id for s in specs]
        deadline = time.monotonic() + 300
        while True:
            start, counts = overlap(await _ledgers(cluster, ids))
            if min(counts) >= WINDOW:
                break
            assert time.monotonic() < deadline, counts
            for i in ids:
                exp = await client.get(i)
                assert not is_terminal(exp), (state_name(exp.state), exp.message)
            await asyncio.sleep(0.5)
        end = time.time()
        for i in ids[:-1]:
            await client.cancel(i)
        # the last one running is given the whole fleet (rebalanced) before it is cancelled
        while not rebalanced(cluster, ids[-1], SLOTS[-1]):
            assert time.monotonic() < deadline, "the last experiment kept its share"
            await asyncio.sleep(0.2)
        await client.cancel(ids[-1])
        exps = [await client.get(i) for i in ids]
        while not all(map(is_terminal, exps)):
            await asyncio.sleep(0.5)
            exps = [await client.get(i) for i in ids]
        return exps, start, end


def test_three_lora_experiments_share_two_rollouts_by_weight(cluster, task):
    specs = [shared_spec(task, f"shared-{i}", s) for i, s in enumerate(SHARES)]
    t0 = time.monotonic()
    exps, start, end = asyncio.run(run_together(cluster, specs))
    wall = time.monotonic() - t0
    for exp in exps:
        assert state_name(exp.state) == "CANCELLED", exp.message
        report = wait_for(lambda exp=exp: _settled_ledger(cluster, exp), timeout=30)
        totals = report["totals"]
        assert totals["lost"] == totals["trained_twice"] == 0, totals
        assert totals["trained"] == report["trained_groups"] == report["steps"] * BATCH, report
        # the record holds every step of the ledger, the one trained as the cancel came too
        assert report["steps"] == exp.progress.last_step.version, (report, exp.progress)

    ledgers = asyncio.run(_ledgers(cluster, [e.id for e in exps]))
    held = [slot_seconds(events, start, end) for events in ledgers]
    measured = [h / sum(held) for h in held]
    wanted = [s / sum(SHARES) for s in SHARES]
    print(
        f"wall {wall:.1f}s window {end - start:.1f}s slots in use {sum(held) / (end - start):.2f}"
    )
    print("measured", [round(m, 3) for m in measured], "wanted", wanted)
    # the shares bound: while all three ran, each filled every slot of its part of the fleet
    # at some point (a count of events, whatever the machine's load; how much of the window
    # the slots were in use depends on how fast the trainers keep up)
    most = [most_held(ev, start, end) for ev in ledgers]
    assert all(m >= want for m, want in zip(most, SLOTS, strict=True)), (most, held)
    for got, want in zip(measured, wanted, strict=True):
        assert abs(got - want) <= 0.10 * want, (measured, wanted)

    # the scheduler divided the 8 slots 2 / 2 / 4 while all three ran (and gave the last one
    # running more once the others had ended: run_together waited for that)
    log = cluster.var / "log"
    slots = [slots_divided(cluster, x.id) for x in exps]
    for got, want in zip(slots, SLOTS, strict=True):
        assert (want, 2 * CAPACITY) in got, slots
    # each experiment shared both rollouts, and none fenced one
    bound = log_events(log / "scheduler-0.log", "worker_bound")
    for exp in exps:
        assert (
            len({e["worker"] for e in bound if e["experiment"] == exp.id and e.get("shared")}) == 2
        )
    assert not log_events(log / "scheduler-0.log", "rollout_fenced")
