"""bench.gpu: the logprob-mismatch arithmetic, the parameter count and the math part's ledger
verdict and spec overrides, exact values by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.types import Sample, TrajectoryGroup
from bench.gpu import mismatch
from bench.gpu.shapes import n_params


def _group(*samples: Sample) -> TrajectoryGroup:
    return TrajectoryGroup("e", "g", "p", "", "", [1, 2], list(samples))


GROUPS = [
    _group(
        Sample(output_ids=[5, 6, 7], logprobs=[-1.0, -2.0, -0.5], versions=[0, 0, 1]),
        # an environment token (loss_mask 0) at version 1 is no policy token: not counted
        Sample(output_ids=[8, 9], logprobs=[-0.25, 0.0], versions=[1, 1], loss_mask=[1, 0]),
    )
]
# what the trainer recomputes for the same tokens
TRAINER = [[[-1.5, -2.0, -0.75], [-0.5, -3.0]]]


def test_deltas_only_tokens_of_the_version_and_policy_tokens():
    # trainer - rollout: v0 tokens (-1.5 - -1.0, -2.0 - -2.0); v1 (-0.75 - -0.5, -0.5 - -0.25)
    assert mismatch.deltas(GROUPS, TRAINER, 0) == [-0.5, 0.0]
    assert mismatch.deltas(GROUPS, TRAINER, 1) == [-0.25, -0.25]
    assert mismatch.deltas(GROUPS, TRAINER, 2) == []


def test_measure_mean_abs_over_all_versions():
    calls = []

    def logprobs_at(version, groups):
        calls.append(version)
        return TRAINER

    got = mismatch.measure(GROUPS, [0, 1, 2], logprobs_at)
    assert calls == [0, 1]  # no group holds a token of version 2: nothing recomputed
    # |deltas| 0.5, 0, 0.25, 0.25: mean 1.0 / 4; signed (-0.5 - 0.25 - 0.25) / 4
    assert got["tokens"] == 4
    assert got["mean_abs"] == pytest.approx(0.25)
    assert got["max_abs"] == 0.5
    assert got["mean_signed"] == pytest.approx(-0.25)
    assert got["per_version"] == {0: 0.25, 1: 0.25}


def test_summarize_without_tokens():
    assert mismatch.summarize({}) == {"tokens": 0}


def test_n_params_of_the_published_models():
    # SmolLM2-135M: 134,515,008 parameters (HuggingFaceTB/SmolLM2-135M, safetensors metadata);
    # Qwen2.5-0.5B: 494,032,768 (Qwen/Qwen2.5-0.5B, 0.49B, tied embeddings); both also what
    # transformers counts for these configs (sum of numel over a meta-device model)
    assert n_params("smollm2-135m") == 134_515_008
    assert n_params("qwen2-0.5b") == 494_032_768


def test_trainer_diff_is_token_weighted_over_the_steps_that_measured_it():
    from bench.gpu.stack import _trainer_diff

    history = [
        {"step": 1},  # no token at the trainer's version this step
        {"logprob_diff_mean": 0.01, "logprob_diff_max": 0.05, "logprob_diff_tokens": 100},
        {"logprob_diff_mean": 0.04, "logprob_diff_max": 0.02, "logprob_diff_tokens": 300},
    ]
    # (0.01 * 100 + 0.04 * 300) / 400 = 13 / 400 = 0.0325; max of the maxima
    assert _trainer_diff(history) == {
        "steps": 2,
        "tokens": 400,
        "mean_abs": pytest.approx(0.0325, abs=1e-12),
        "max_abs": 0.05,
    }
    assert _trainer_diff([{"step": 1}]) == {"steps": 0, "tokens": 0}


def _ledger(steps: int, groups: int, **fates) -> dict:
    totals = {"trained": groups, "left_over": 0, "lost": 0, "trained_twice": 0, "in_flight": 0}
    return {"totals": totals | fates, "steps": steps, "trained_groups": groups}


def test_math_ledger_problems_clean_ledger_finds_none():
    from bench.gpu.math_recipe import ledger_problems

    assert ledger_problems(_ledger(3, 12, left_over=5), steps=3, batch_size=4) == []


def test_math_ledger_problems_lost_or_short_steps_are_findings():
    from bench.gpu.math_recipe import ledger_problems

    assert ledger_problems(_ledger(3, 12, lost=1), 3, 4) == ["ledger: 1 lost"]
    assert ledger_problems(_ledger(2, 8), 3, 4) == ["ledger: 2 steps, the experiment 3"]
    # a step that took 3 groups of B=4, and a prompt trained twice counted once in `trained`
    assert ledger_problems(_ledger(3, 11, trained=10, trained_twice=1), 3, 4) == [
        "ledger: 1 trained_twice",
        "ledger: 11 groups in 3 steps of 4",
        "ledger: 10 prompts trained, 11 groups",
    ]


def test_math_overrides_keep_the_recipes_reward_trainer_and_objective():
    from asyncrl.cli import load_spec_dict
    from bench.gpu.math_recipe import DATA, SPEC, overrides

    sizes = dict(batch_size=4, n_samples=4, max_new_tokens=64, total_steps=3, eval_prompts=4)
    recipe = load_spec_dict(SPEC)
    spec = load_spec_dict(SPEC, overrides(Path("/m"), sizes))
    assert spec["model"]["path"] == "/m" and spec["dataset"]["path"] == str(DATA)
    assert spec["rollout"]["engine"] == "torch" and spec["rollout"]["filter"] == "none"
    assert spec["trainer"]["total_steps"] == 3
    assert spec["rollout"]["gconfig"]["max_new_tokens"] == 64
    assert spec["reward"] == recipe["reward"]
    # the trainer section (backend, optimizer, objective) is the recipe's but for its sizes
    sized = {"batch_size", "total_steps"}
    assert {k: v for k, v in spec["trainer"].items() if k not in sized} == {
        k: v for k, v in recipe["trainer"].items() if k not in sized
    }
    assert spec["trainer"]["backend"] == "megatron"
