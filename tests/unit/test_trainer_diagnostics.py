"""The off-policy diagnostics of a step (services/trainer/metrics.py): what the backend
measured copied into StepMetrics, the staleness histogram and the version span of a sample,
counted by hand."""

from __future__ import annotations

from asyncrl.types import Sample, StepMetrics, TrajectoryGroup
from asyncrl.v1 import common_pb2
from services.trainer.metrics import (
    DIAGNOSTIC_FIELDS,
    staleness_histogram,
    step_metrics,
    version_spans,
)


def _group(gid: str, start: int, versions: list[list[int]], masks=None) -> TrajectoryGroup:
    masks = masks or [[] for _ in versions]
    samples = [
        Sample(output_ids=[5] * len(v), logprobs=[-1.0] * len(v), versions=v, reward=1.0,
               loss_mask=m)
        for v, m in zip(versions, masks, strict=True)
    ]  # fmt: skip
    return TrajectoryGroup("e", gid, "p" + gid, "q", "a", [1, 2], samples, start_version=start)


def test_staleness_histogram_buckets_0_1_2to3_4to7_8plus():
    got = staleness_histogram([0, 0, 1, 2, 3, 4, 7, 8, 20])
    assert got == {
        "staleness_0": 2,
        "staleness_1": 1,
        "staleness_2_3": 2,
        "staleness_4_7": 2,
        "staleness_8_plus": 2,
    }


def test_version_span_counts_trained_tokens_only():
    # sample 1: versions 3..5 -> 2; sample 2: one version -> 0; sample 3: the env token at v9
    # is not trained -> 4..4 -> 0; sample 4: no tokens -> no span
    g = _group("a", 3, [[3, 4, 5], [3, 3], [4, 9, 4], []], masks=[[], [], [1, 0, 1], []])
    assert version_spans([g]) == [2, 0, 0]


def test_step_metrics_carry_the_backend_diagnostics_and_histogram():
    groups = [_group("a", 5, [[5, 6]]), _group("b", 3, [[3, 3]]), _group("c", 6, [[6]])]
    stats = {
        "behav_weight_mean": 1.25,
        "behav_weight_max": 4.0,
        "is_masked_fraction": 0.1,
        "is_truncated_fraction": 0.2,
        "logprob_diff_mean": 0.001,
        "logprob_diff_max": 0.01,
        "logprob_diff_tokens": 7.0,
    }
    m = step_metrics(
        step=1,
        version=7,
        groups=groups,
        trainer_version=6,
        backend_stats=stats,
        step_time_s=1.0,
        stale_dropped=0,
    )
    for key, value in stats.items():
        assert getattr(m, key) == value, key
    assert isinstance(m.logprob_diff_tokens, int)
    # staleness 6-5 = 1, 6-3 = 3, 6-6 = 0
    assert (m.staleness_0, m.staleness_1, m.staleness_2_3, m.staleness_4_7) == (1, 1, 1, 0)
    assert (m.version_span_max, m.version_span_mean) == (1, 1 / 3)
    assert StepMetrics.from_proto(m.to_proto()) == m  # the wire keeps them


def test_every_diagnostic_is_a_step_metrics_field():
    names = set(common_pb2.StepMetrics.DESCRIPTOR.fields_by_name)
    assert set(DIAGNOSTIC_FIELDS) <= names
