"""The trainer's time accounting around a step: the stall and the StepMetrics timing fields."""

from __future__ import annotations

import pytest

from services.trainer.metrics import StepTimes, stall_seconds, step_metrics


def test_stall_seconds_first_step_of_a_run_is_zero():
    assert stall_seconds(None, 100.0, 0.5) == 0.0


def test_stall_seconds_gap_between_steps_less_the_wait():
    assert stall_seconds(10.0, 10.75, 0.5) == pytest.approx(0.25)


def test_stall_seconds_never_negative():
    assert stall_seconds(10.0, 10.1, 0.2) == 0.0


def test_step_metrics_carry_the_step_times():
    times = StepTimes(
        wait_s=1.0,
        serialize_s=0.1,
        write_s=0.2,
        commit_s=0.3,
        checkpoint_s=0.4,
        stall_s=0.9,
        weight_bytes_sent=4096,
        weight_bytes_full=65536,
    )
    m = step_metrics(
        step=3,
        version=3,
        groups=[],
        trainer_version=2,
        backend_stats={},
        step_time_s=2.0,
        stale_dropped=0,
        times=times,
    )
    got = (m.wait_s, m.serialize_s, m.write_s, m.commit_s, m.checkpoint_s, m.stall_s)
    assert got == (1.0, 0.1, 0.2, 0.3, 0.4, 0.9)
    assert m.to_proto().stall_s == 0.9  # a proto field: stored and reported as any other
    assert (m.weight_bytes_sent, m.to_proto().weight_bytes_full) == (4096, 65536)
