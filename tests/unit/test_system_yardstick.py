"""The system benchmark's yardsticks (bench.yardstick), its decode fit over two replays
(bench.decode.fit_decode), the engine counters over a run's wall (bench.system.counters_between),
and the recorded run in docs/system-run.json: its efficiency at every eta is at most 1.0 plus
the run's stated noise, and its fleet utilisation and losses sum to 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.decode import fit_decode, fit_line
from bench.system import counters_between
from bench.yardstick import EngineUse, efficiencies, losses, noise, spread

RECORD = Path(__file__).resolve().parents[2] / "docs" / "system-run.json"


def test_spread_and_noise_by_hand():
    assert spread([10.0, 9.0]) == pytest.approx(0.1)  # (10 - 9) / 10
    assert spread([5.0]) == 0.0
    assert spread([]) == 0.0
    assert noise([[10.0, 9.0], [4.0, 4.0], [5.0]]) == pytest.approx(0.1)  # the largest


def test_efficiencies_by_hand():
    effs = efficiencies({0: 1.0, 1: 2.0}, {0: 1.25, 1: 2.0}, 0.1)
    assert [e.value for e in effs] == [0.8, 1.0]  # measured / model
    assert [e.measured_speedup for e in effs] == [1.0, 2.0]  # 2.0 / 1.0
    assert [e.model_speedup for e in effs] == [1.0, 1.6]  # 2.0 / 1.25
    assert [e.goal_met for e in effs] == [False, True]  # goal 0.85
    assert all(e.bounded for e in effs)
    above = efficiencies({0: 1.0, 1: 2.3}, {0: 1.0, 1: 2.0}, 0.1)[1]
    assert above.value == pytest.approx(1.15)
    assert not above.bounded  # 1.15 > 1 + 0.1


def test_losses_by_hand_sum_to_the_gap():
    # capacity = 200 tokens/s x 10 s = 2000 tokens; trained 300 -> utilisation 0.15
    use = EngineUse(wall_s=10.0, trained_tokens=300, generated_tokens=500, rejected_tokens=40,
                    untrained_tokens=60, steps=100, busy_s=6.0, prefill_s=1.0, pause_s=0.5)  # fmt: skip
    util, lost = losses(use, saturated=200.0, t0=0.01, c1=0.004)
    assert util == pytest.approx(0.15)
    assert lost.stale == pytest.approx((500 - 300 - 40 - 60) / 2000)  # 0.05
    assert lost.filter_rejects == pytest.approx(40 / 2000)
    assert lost.untrained_at_end == pytest.approx(60 / 2000)
    # fitted cost of the steps taken: 100 x 0.01 + 0.004 x 500 = 3 s = 600 tokens at saturation
    assert lost.tail == pytest.approx((600 - 500) / 2000)
    assert lost.slow_steps == pytest.approx(200 * (6.0 - 1.0 - 3.0) / 2000)  # decode 5 s vs 3 s
    assert lost.prefill == pytest.approx(200 * 1.0 / 2000)
    assert lost.update_pauses == pytest.approx(200 * 0.5 / 2000)
    assert lost.waiting == pytest.approx(200 * (10 - 6 - 0.5) / 2000)  # idle: 3.5 s
    assert util + lost.total() == pytest.approx(1.0)


def test_fit_decode_takes_the_faster_replay_at_each_occupancy():
    a = [(1, 0.002, False), (2, 0.003, False), (4, 0.005, False)]
    b = [(1, 0.004, False), (2, 0.003, False), (4, 0.004, False), (4, 0.020, True)]
    d = fit_decode([a, b], slots=4)
    t0, c1 = fit_line([1, 2, 4], [0.002, 0.003, 0.004])
    assert (d.t0, d.c1) == (t0, c1)
    assert d.steps == 6
    assert d.resume_streams == 4.0
    assert d.resume_stall_s == pytest.approx(0.020 - (t0 + 4 * c1))
    assert d.full_fleet_step_s == pytest.approx((0.005 + 0.004) / 2)  # a >= 0.9 x 4


def test_counters_between_interpolates_the_polls():
    polls = [(0.0, {"steps": 0.0}), (1.0, {"steps": 10.0}), (3.0, {"steps": 30.0}), (4.0, {})]
    assert counters_between(polls, 0.5, 2.0) == {"steps": 15.0}  # 20 - 5
    assert counters_between(polls[:1], 0.0, 1.0) == {}


def test_recorded_run_is_bounded_by_its_model():
    record = json.loads(RECORD.read_text())
    effs = [r for r in record["results"] if r["metric"] == "system_efficiency"]
    assert sorted(r["settings"]["eta"] for r in effs) == [0, 1, 2, 4]
    for r in effs:
        s = r["settings"]
        assert r["value"] / r["peer_value"] <= 1.0 + s["noise"], f"eta={s['eta']}: {s['summary']}"
    utils = [r for r in record["results"] if r["metric"] == "fleet_utilisation"]
    assert len(utils) == 4
    for r in utils:
        s = r["settings"]
        assert s["utilisation"] + sum(s["losses"].values()) == pytest.approx(1.0, abs=1e-3)
