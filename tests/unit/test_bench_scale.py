"""The scale benchmark's arithmetic (bench/scale.py), on hand-made inputs; the run itself is in
`make bench` and tests/unit/test_bench_smoke.py."""

from __future__ import annotations

import math

import pytest

from bench.scale import Sizes
from bench.scale_figures import dispatch_latencies, in_window, lapsed, percentile, sweep_us


def test_percentile_nearest_rank():
    # nearest rank: the ceil(q/100 * n)-th smallest value (NIST handbook, "percentile")
    values = [7.0, 1.0, 3.0, 10.0, 2.0, 9.0, 4.0, 8.0, 6.0, 5.0]
    assert percentile(values, 50) == 5.0
    assert percentile(values, 90) == 9.0
    assert percentile(values, 99) == 10.0
    assert percentile(values, 0) == 1.0
    assert math.isnan(percentile([], 50))


def test_dispatch_latency_first_arrival_at_or_after_each_dispatch():
    window = {"start": 100.0, "end": 110.0}
    ledgers = {
        "e": [
            {"event": "dispatched", "group": "g1", "t": 100.000},
            {"event": "dispatched", "group": "g2", "t": 100.010},
            {"event": "settled", "group": "g1", "t": 101.0},
            {"event": "dispatched", "group": "g2", "t": 105.000},  # re-queued, sent again
            {"event": "dispatched", "group": "g3", "t": 106.000},  # its rollout was killed
            {"event": "dispatched", "group": "g4", "t": 99.0},  # before the window
        ]
    }
    arrivals = {"g1": [100.004], "g2": [100.0095, 105.020], "g4": [99.5]}
    latencies, unseen = dispatch_latencies(ledgers, arrivals, window)
    # g1: 4 ms; g2's first: 0.5 ms early (ms-rounded ledger time) counts as 0; g2's second: 20 ms
    assert latencies == pytest.approx([0.004, 0.0, 0.020])
    assert unseen == 1


def test_in_window_is_inclusive():
    w = {"start": 1.0, "end": 2.0}
    assert in_window(1.0, w) and in_window(2.0, w) and not in_window(2.0001, w)


def test_sizes_offered_load_and_reduced_fits_make_bench():
    full, reduced = Sizes(), Sizes.reduced()
    assert (full.rollouts, full.rewards, full.experiments) == (1000, 100, 10)
    assert full.max_concurrent == 128  # (eta + 1) * B = 2 * 64
    assert full.offered_groups_per_s == pytest.approx(10 * 128 / 8.0)
    assert reduced.offered_groups_per_s == pytest.approx(2 * 32 / 2.0)
    assert full.heartbeat_interval_s == reduced.heartbeat_interval_s == 1.0


def test_sweep_of_the_real_registry_is_timed():
    us = sweep_us(Sizes.reduced(), repeats=20)
    assert 0 < us < 1e6


def test_lapsed_counts_expiries_of_live_workers_only():
    # 2 expiries before the kill (live workers whose lease lapsed); 3 after it, of which the
    # 2 killed rollouts' own are expected: 1 more live worker lapsed
    raw = {"expired": [1.0, 2.0, 10.0, 11.0, 12.0], "vanish": {"killed_at": 5.0}}
    assert lapsed(raw, vanish=2) == 3
    assert lapsed({"expired": [1.0, 2.0]}, vanish=2) == 2  # broke before the kill


def test_liveness_of_a_window_from_the_schedulers_lines():
    from bench.scale_figures import liveness_ms

    live = [
        {"t": 99.0, "lag_ms_p50": 50.0, "lag_ms_p99": 900.0, "lag_ms_max": 950.0},  # before
        {"t": 105.0, "lag_ms_p50": 2.0, "lag_ms_p99": 8.0, "lag_ms_max": 12.0},
        {"t": 110.0, "lag_ms_p50": 4.0, "lag_ms_p99": 6.0, "lag_ms_max": 30.0},
    ]
    got = liveness_ms(live, {"start": 100.0, "end": 110.0})
    # the median (nearest rank) of 2 and 4 is 2; the largest p99 and max of the two in it
    assert got == {"heartbeat_ms_p50": 2.0, "heartbeat_ms_p99": 8.0, "heartbeat_ms_max": 30.0}
    assert math.isnan(liveness_ms(live, {"start": 0.0, "end": 1.0})["heartbeat_ms_p99"])


def test_lapsed_ignores_the_expiries_after_the_last_window():
    # the stand-ins are stopped one after the other after the idle window: their leases lapse
    raw = {"expired": [5.0, 50.0, 51.0, 99.0], "idle": {"end": 60.0}}
    assert lapsed(raw, vanish=0) == 3  # 99.0 is after the end
