"""The control-plane benchmark's own pieces: the zero engine, the no-op trainer backend, the step
watch over the trainer's log, the window arithmetic and the spec it submits."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.spec import SamplingParams, validate_spec
from asyncrl.types import Sample, TrajectoryGroup
from bench.control_plane import (
    Round,
    Sizes,
    StepWatch,
    Window,
    best,
    experiment_spec,
    median_round,
    write_dataset,
)
from bench.speed import SpeedProbe, reference, slowdown
from bench.zero import NoopBackend, ZeroEngine
from services.rollout.engine import GenRequest


def test_zero_engine_generate_answers_fixed_length_at_served_version():
    engine = ZeroEngine(output_len=16)

    async def go():
        await engine.load("/m", 3)
        short = await engine.generate(GenRequest("a", [1, 2], SamplingParams(max_new_tokens=4)))
        await engine.update_weights("/m", 4)
        full = await engine.generate(GenRequest("b", [1, 2], SamplingParams(max_new_tokens=64)))
        return short, full

    short, full = asyncio.run(go())
    assert len(short.output_ids) == len(short.logprobs) == len(short.versions) == 4
    assert short.versions == [3] * 4
    assert len(full.output_ids) == 16 and full.versions == [4] * 16
    assert full.finish_reason == "length"


def test_noop_backend_step_counts_tokens_and_saves_the_config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 99}')
    backend = NoopBackend(validate_spec({"model": {"path": str(model)}, "dataset": {"path": "x"}}))
    backend.load(str(model))
    sample = Sample(output_ids=[4, 5, 6], logprobs=[-1.0] * 3, versions=[0] * 3)
    group = TrajectoryGroup("e", "g", "p", "1+1=", "2", [7, 8], [sample, sample])
    assert backend.train_step([group])["tokens"] == 6.0
    out = tmp_path / "v1"
    out.mkdir()
    backend.save_hf(out)
    assert json.loads((out / "config.json").read_text()) == {"vocab_size": 99}
    assert backend.logprobs([group]) == [[[-1.0] * 3, [-1.0] * 3]]


def test_step_watch_reads_train_step_lines_and_waits_for_a_partial_line(tmp_path):
    log = tmp_path / "trainer.log"
    watch = StepWatch(log)
    assert watch.poll() == 0  # no file yet
    lines = [
        json.dumps({"event": "train_step", "step": 1}),
        "not json at all",
        "train_step, but not json",
        json.dumps({"event": "checkpoint_saved", "step": 9}),
        json.dumps({"event": "train_step", "step": 2}),
    ]
    log.write_text("\n".join(lines) + "\n" + '{"event": "train_step", "st')
    assert watch.poll() == 2
    with open(log, "a") as f:
        f.write('ep": 3}\n')
    assert watch.poll() == 3


def test_window_per_group_figures():
    w = Window(groups=64, seconds=2.0, cpu_s={"a": 0.064, "b": 0.032}, main_thread_s={"a": 0.032})
    assert w.groups_per_s == 32.0
    assert w.cpu_us_per_group == pytest.approx(1500.0)
    assert w.per_group(w.main_thread_s) == {"a": 500.0}


def test_best_window_is_the_one_with_the_fewest_cpu_us_per_group():
    slow = Window(groups=64, seconds=2.0, cpu_s={"a": 0.064})  # 1000 µs/group, 32 groups/s
    cheap = Window(groups=32, seconds=2.0, cpu_s={"a": 0.016})  # 500 µs/group, 16 groups/s
    assert best([slow, cheap, slow]) is cheap


def test_experiment_spec_is_valid_with_the_benchmark_sizes(tmp_path):
    dataset = write_dataset(tmp_path / "train.jsonl", prompts=8)
    assert len(dataset.read_text().splitlines()) == 8
    spec = validate_spec(experiment_spec(tmp_path / "model", dataset, Sizes()))
    assert spec.rollout.n_samples == 8 and spec.trainer.batch_size == 32
    assert spec.rollout.filter == "none"  # the zero engine's answers are all wrong
    assert spec.rollout.engine == "torch" and spec.trainer.backend == "torch"


def test_speed_reference_is_the_fast_quantile_and_slowdown_the_mean_over_it():
    samples = [0.028, 0.054, 0.029, 0.030, 0.052, 0.028, 0.031, 0.055, 0.029, 0.030, 0.028]
    ref = reference(samples)  # the 10th percentile of 11: index 1 of the sorted list
    assert ref == 0.028
    assert slowdown([0.028, 0.056], ref) == pytest.approx(1.5)
    assert slowdown([], ref) == 1.0


def test_speed_probe_samples_between_two_times(tmp_path):
    (tmp_path / "cpu0.txt").write_text("10.0 0.03\n11.0 0.05\n12.5 0.06\n")
    (tmp_path / "cpu1.txt").write_text("10.5 0.04\n13.0 0.07\npartial")
    probe = SpeedProbe(tmp_path)
    assert sorted(probe.samples(10.2, 12.5)) == [0.04, 0.05, 0.06]
    assert len(probe.samples()) == 5


def test_round_ratio_at_reference_speed_and_the_median_round():
    def window(cpu_us: float) -> Window:
        return Window(groups=1000, seconds=1.0, cpu_s={"all": cpu_us * 1000 / 1e6})

    slow = Round(window(2000), {"cpu_us_per_rollout": 1000}, ours_slowdown=2.0)
    even = Round(window(1200), {"cpu_us_per_rollout": 1000})
    peer_slow = Round(window(1500), {"cpu_us_per_rollout": 2000}, peer_slowdown=2.0)
    assert slow.raw_ratio == pytest.approx(2.0) and slow.ratio == pytest.approx(1.0)
    assert slow.ours_cpu_us == pytest.approx(1000)
    assert peer_slow.raw_ratio == pytest.approx(0.75) and peer_slow.ratio == pytest.approx(1.5)
    assert median_round([slow, even, peer_slow]) is even
    assert median_round([slow, peer_slow]) is slow  # the lower middle of an even count
