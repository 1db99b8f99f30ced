"""bench.offpolicy's pure aggregation: steps to accuracy, mean and sample std over seeds, the
cells of the report, and the rule that may change the default correction. Expected values are
computed by hand from the definitions (sample standard deviation: sqrt(sum (x - mean)^2 /
(n - 1)), Python's statistics.stdev)."""

from __future__ import annotations

import math

import pytest

from bench.offpolicy import (
    DEFAULT,
    SAME_ON_POLICY,
    Cell,
    Plan,
    RunRecord,
    aggregate,
    clear_winner,
    mean_std,
    steps_to_accuracy,
    with_on_policy_twins,
)


def rec(seed, eta, corr, evals, staleness=0.0, masked=0.0) -> RunRecord:
    return RunRecord(
        seed=seed,
        eta=eta,
        correction=corr,
        evals=evals,
        staleness_mean=staleness,
        masked_fraction=masked,
        truncated_fraction=0.0,
        wall_s=1.0,
    )


def test_steps_to_accuracy_is_the_first_version_at_or_above_the_threshold():
    evals = [(0, 0.15), (5, 0.35), (10, 0.40), (15, 0.38), (20, 0.55)]
    assert steps_to_accuracy(evals, 0.4) == 10  # reaching it exactly counts
    assert steps_to_accuracy(evals, 0.5) == 20
    assert steps_to_accuracy(evals, 0.1) == 0
    assert steps_to_accuracy(evals, 0.6) is None
    assert steps_to_accuracy(list(reversed(evals)), 0.36) == 10  # version order, not list order


def test_mean_std_is_the_mean_and_sample_standard_deviation():
    # 0.2, 0.4, 0.6: mean 0.4; squared deviations 0.04 + 0 + 0.04 = 0.08; / (3 - 1) = 0.04
    mean, std = mean_std([0.2, 0.4, 0.6])
    assert mean == pytest.approx(0.4, abs=1e-12)
    assert std == pytest.approx(0.2, abs=1e-12)
    # 1, 2, 3, 4: mean 2.5; deviations^2 2.25 + 0.25 + 0.25 + 2.25 = 5; 5 / 3
    assert mean_std([1, 2, 3, 4]) == pytest.approx((2.5, math.sqrt(5 / 3)), abs=1e-12)
    assert mean_std([0.7]) == (0.7, 0.0)  # one seed: no spread


def test_aggregate_groups_by_eta_and_correction_over_seeds():
    records = [
        rec(2, 4, "token_cap", [(0, 0.1), (5, 0.3), (10, 0.5)], staleness=3.0, masked=0.1),
        rec(1, 4, "token_cap", [(0, 0.1), (5, 0.45), (10, 0.3)], staleness=2.0, masked=0.3),
        rec(1, 4, "icepop", [(0, 0.1), (5, 0.2), (10, 0.35)], staleness=4.0),
        rec(1, 0, "token_cap", [(0, 0.1), (10, 0.6)]),
    ]
    cells = aggregate(records, threshold=0.4)
    assert [(c.eta, c.correction) for c in cells] == [
        (0, "token_cap"),
        (4, "token_cap"),
        (4, "icepop"),
    ]
    eta0, cap, ice = cells
    assert cap.seeds == [1, 2]  # seed order, whatever order the runs came in
    assert cap.final == [0.3, 0.5]  # the last eval of each run
    assert cap.final_mean == pytest.approx(0.4)
    # 0.3, 0.5: deviations 0.1 each; sqrt((0.01 + 0.01) / 1)
    assert cap.final_std == pytest.approx(math.sqrt(0.02))
    assert (cap.reached, cap.steps_mean) == (2, 7.5)  # seed 1 at v5 (0.45), seed 2 at v10
    assert cap.staleness_mean == pytest.approx(2.5)
    assert cap.masked_fraction == pytest.approx(0.2)
    assert (ice.reached, ice.steps_mean, ice.final_std) == (0, None, 0.0)
    assert (eta0.reached, eta0.steps_mean) == (1, 10.0)


def test_on_policy_twins_copy_the_default_cell_at_eta_zero():
    plan = Plan(etas=(0, 4), corrections=(DEFAULT, "icepop", "gspo"), seeds=(1,))
    assert plan.runs() == [(1, 0, DEFAULT), (1, 0, "gspo"), (1, 4, DEFAULT), (1, 4, "icepop"),
                           (1, 4, "gspo")]  # fmt: skip
    cells = aggregate([rec(1, 0, DEFAULT, [(0, 0.1), (5, 0.5)])], threshold=0.4)
    twins = with_on_policy_twins(cells, plan)[1:]
    assert "icepop" in SAME_ON_POLICY and "gspo" not in SAME_ON_POLICY
    assert [(c.eta, c.correction, c.same_as, c.final) for c in twins] == [
        (0, "icepop", DEFAULT, [0.5])
    ]


def cell(corr: str, final: list[float]) -> Cell:
    mean, std = mean_std(final)
    return Cell(eta=8, correction=corr, seeds=[1, 2, 3], final=final, final_mean=mean,
                final_std=std, reached=0, steps_mean=None, staleness_mean=0.0,
                masked_fraction=0.0)  # fmt: skip


def test_clear_winner_must_win_every_seed_by_more_than_the_spread():
    base = cell(DEFAULT, [0.30, 0.40, 0.50])  # mean 0.4, std 0.1
    # mean 0.6 (gain 0.2 > std 0.1 of both), above the default in each seed
    assert clear_winner([base, cell("icepop", [0.50, 0.60, 0.70])], eta=8) == "icepop"
    # the best mean (0.6), but seed 1 loses (0.25 < 0.30): not clear
    assert clear_winner([base, cell("icepop", [0.25, 0.75, 0.80])], eta=8) is None
    # every seed wins, but the gain 0.05 is within the spread (std 0.1)
    assert clear_winner([base, cell("icepop", [0.35, 0.45, 0.55])], eta=8) is None
    # the default is the best: nothing to change
    assert clear_winner([base, cell("icepop", [0.1, 0.2, 0.3])], eta=8) is None
    assert clear_winner([base], eta=4) is None  # no cell at that eta
