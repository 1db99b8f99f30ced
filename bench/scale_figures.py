"""The scale benchmark's figures (`bench.scale`): from the raw run (windows, the ledgers) and
what the stand-ins wrote (`bench.scale_fleet`) to what is reported. Pure arithmetic, except
`sweep_us`, which times the real Registry's sweep in this process."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING

from services.scheduler.registry import Registry, WorkerKind

if TYPE_CHECKING:
    from bench.scale import Sizes


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of `values`; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(q/100 * n), at least 1
    return ordered[int(rank) - 1]


def in_window(t: float, window: dict) -> bool:
    return window["start"] <= t <= window["end"]


def dispatch_latencies(ledgers: dict, arrivals: dict[str, list[float]], window: dict):
    """For every group the ledger says was dispatched in `window`: seconds from that event to
    the first arrival of its GenerateGroups call at or after it (the ledger's times are rounded
    to the millisecond: an arrival up to 1 ms before counts, as 0). Also the dispatches whose
    call never arrived where a stand-in wrote it down (the killed process's)."""
    latencies, unseen = [], 0
    for events in ledgers.values():
        for e in events:
            if e["event"] != "dispatched" or not in_window(e["t"], window):
                continue
            later = [a for a in arrivals.get(e["group"], ()) if a >= e["t"] - 0.001]
            if later:
                latencies.append(max(0.0, min(later) - e["t"]))
            else:
                unseen += 1
    return latencies, unseen


def sweep_us(s: Sizes, repeats: int = 200) -> float:
    """µs per pass of the scheduler's sweeper (`_sweep_forever`: expire, then the idle checks)
    on the real Registry holding this run's workers, the rollouts bound."""
    reg = Registry(s.lease_ttl_s, s.heartbeat_interval_s)
    for i in range(s.rollouts):
        w, _ = reg.register(WorkerKind.ROLLOUT, f"127.0.0.1:{20000 + i}", "", s.capacity)
        reg.bind(w, f"exp-{i % s.experiments}")
    for i in range(s.rewards):
        reg.register(WorkerKind.REWARD, f"127.0.0.1:{30000 + i}", "", 1)
    for i in range(s.experiments):
        w, _ = reg.register(WorkerKind.TRAINER, f"127.0.0.1:{40000 + i}", "", 1)
        reg.bind(w, f"exp-{i}")
    t0 = time.perf_counter()
    for _ in range(repeats):
        gone = reg.expire()
        idle = reg.idle(WorkerKind.ROLLOUT) or reg.idle(WorkerKind.TRAINER)
        assert not gone and not idle
    return 1e6 * (time.perf_counter() - t0) / repeats


def liveness_ms(live: list[dict], window: dict) -> dict:
    """The heartbeats' latency (sent -> applied by the scheduler) over `window`, from the
    scheduler's `liveness` lines (one per REPORT_S: p50, p99, max of the beats applied in it):
    the median of their p50s, the largest p99 and max; nan when none fell in the window."""
    lines = [x for x in live if in_window(x["t"], window)]
    nan = float("nan")
    return {
        "heartbeat_ms_p50": percentile([x["lag_ms_p50"] for x in lines], 50),
        "heartbeat_ms_p99": max((x["lag_ms_p99"] for x in lines), default=nan),
        "heartbeat_ms_max": max((x["lag_ms_max"] for x in lines), default=nan),
    }


def window_beats(window: dict, beats: list[tuple], stats: dict[str, dict], live) -> dict:
    """The scheduler's share, and the heartbeats' latency and failures, over `window`."""
    registered = sum(
        1 for st in stats.values() for t in st["registrations"] if in_window(t, window)
    )
    failed = sum(
        1 for st in stats.values() for t in st["heartbeat_failures"] if in_window(t, window)
    )
    return {
        "seconds": round(window["seconds"], 1),
        "scheduler_share": round(window["share"]["scheduler"], 3),
        **liveness_ms(live, window),
        "heartbeats_failed": failed,
        "registrations": registered,
    }


def figures(raw: dict, stats: dict[str, dict], s: Sizes) -> dict:
    """The raw run and the stand-ins' stats -> the reported figures (settings of each result),
    as far as the run got."""
    beats = [tuple(b) for st in stats.values() for b in st["heartbeats"]]
    live = raw.get("liveness", [])
    f: dict = {
        "sizes": asdict(s),
        "broke": raw.get("broke"),
        "lapsed_live_workers": lapsed(raw, s.vanish),
        "registrations": sum(len(st["registrations"]) for st in stats.values()),
        "commit_failures": sum(st.get("commit_failures", 0) for st in stats.values()),
        "register_failures": dict(
            sum((Counter(st.get("register_failures", {})) for st in stats.values()), Counter())
        ),
        "sweep_us": round(sweep_us(s), 1),
    }
    if "bind_s" in raw:
        spread = list(raw["bound_before"].values())
        f["bind_s"], f["rollouts_per_experiment"] = (
            round(raw["bind_s"], 2),
            [min(spread), max(spread)],
        )
    if "bind" in raw:
        f["bind"] = window_beats(raw["bind"], beats, stats, live)
    if "idle" in raw:
        f["idle"] = idle_figures(raw["idle"], beats, stats, live)
        f["cancel_s"] = round(raw["idle"]["cancel_s"], 2)
    if "steady" in raw:
        f["steady"] = steady_figures(raw, stats, beats, s, live)
        if "idle" in f:  # what the experiments add to the heartbeats' cost, per group
            extra = f["steady"]["scheduler_share"] - f["idle"]["scheduler_share"]
            f["steady"]["cpu_us_per_group"] = round(1e6 * extra / f["steady"]["groups_per_s"], 1)
    if "settle_end" in raw.get("vanish", {}):
        f["vanish"] = vanish_figures(raw, stats, s)
    return f


def lapsed(raw: dict, vanish: int) -> int:
    """Live workers the scheduler expired: its `worker_expired` events up to the end of the
    last window (not those of the stand-ins stopped one after the other at the end), but for
    the killed process's rollouts (those after the kill, up to their number)."""
    end = raw.get("idle", {}).get("end", float("inf"))
    expired = [t for t in raw["expired"] if t <= end]
    killed_at = raw.get("vanish", {}).get("killed_at")
    if killed_at is None:
        return len(expired)
    before = sum(1 for t in expired if t < killed_at)
    after = sum(1 for t in expired if t >= killed_at)
    return before + max(0, after - vanish)


def idle_figures(idle: dict, beats: list[tuple], stats: dict[str, dict], live) -> dict:
    """Heartbeats only: the scheduler's CPU per heartbeat or registration (after a lapsed
    lease), the heartbeats' latency."""
    lat = [x for t, x in beats if in_window(t, idle)]
    registered = sum(1 for st in stats.values() for t in st["registrations"] if in_window(t, idle))
    rpcs = max(1, len(lat) + registered)
    return {
        "scheduler_share": round(idle["share"]["scheduler"], 3),
        "nats_share": round(idle["share"]["nats"], 3),
        "heartbeats_per_s": round(len(lat) / idle["seconds"], 1),
        "registrations_per_s": round(registered / idle["seconds"], 1),
        "cpu_us_per_worker_rpc": round(1e6 * idle["cpu_s"]["scheduler"] / rpcs, 1),
        **liveness_ms(live, idle),
    }


def steady_figures(raw: dict, stats: dict[str, dict], beats: list[tuple], s: Sizes, live) -> dict:
    steady = raw["steady"]
    arrivals: dict[str, list[float]] = {}
    for st in stats.values():
        for group, t in st.get("arrivals", ()):
            arrivals.setdefault(group, []).append(t)
    latencies, unseen = dispatch_latencies(raw["ledgers"], arrivals, steady)
    return {
        "seconds": round(steady["seconds"], 1),
        "scheduler_share": round(steady["share"]["scheduler"], 3),
        "nats_share": round(steady["share"]["nats"], 3),
        "groups_per_s": round((len(latencies) + unseen) / steady["seconds"], 1),
        "offered_groups_per_s": round(s.offered_groups_per_s, 1),
        "dispatch_ms_p50": round(1e3 * percentile(latencies, 50), 2),
        "dispatch_ms_p99": round(1e3 * percentile(latencies, 99), 2),
        "dispatch_ms_max": round(1e3 * max(latencies, default=float("nan")), 2),
        "dispatches_unseen": unseen,
        **liveness_ms(live, steady),
        "versions": steady["versions"],
        "weight_updates_total": sum(st.get("updates", 0) for st in stats.values()),
    }


def vanish_figures(raw: dict, stats: dict[str, dict], s: Sizes) -> dict:
    gone, joined = raw["vanish"], stats["joined"]
    retried = [
        e["t"] for ev in raw["ledgers"].values() for e in ev
        if e["event"] == "retried" and gone["killed_at"] <= e["t"] <= gone["settle_end"]
    ]  # fmt: skip
    first = min((t for _, t in joined["arrivals"]), default=float("nan"))
    counts = list(raw.get("bound_after", {"-": 0}).values())
    return {
        "rollouts": s.vanish,
        "expired_s": round(gone["expired_at"] - gone["killed_at"], 2),
        "requeued_groups": len(retried),
        "requeued_within_s": round(max(retried, default=gone["killed_at"]) - gone["killed_at"], 2),
        "scheduler_share_meanwhile": round(gone["cpu"]["share"]["scheduler"], 3),
        "joined_bound_s": round(gone["bound_at"] - joined["registering"], 2),
        "joined_first_group_s": round(first - joined["registering"], 2),
        "rollouts_per_experiment_after": [min(counts), max(counts)],
    }
