"""`make gpu-check GPU_ARGS=--dry-run`: the GPU readiness script end to end on the CPU.

Every part runs for real with tiny shapes (megatron-core train steps, the torch engine with an
interrupt + weight update, the math recipe's GPU spec and the SmolLM2 task through nats + all
services under the supervisor with the megatron trainer) and the report must say what each
part measured. On the CPU everything is fp32, so the
rollout/trainer logprob mismatch is float rounding only: a regression in either side's
logprobs (or in the bookkeeping of versions) shows up as a large mismatch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cluster import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    got = json.loads((out / "report.json").read_text())
    got["_md"] = (out / "report.md").read_text()
    got["_rc"], got["_stdout"] = done.returncode, done.stdout + done.stderr
    return got


def _parts(report, part):
    return [p for p in report["parts"] if p["part"] == part]


def test_every_part_passes(report):
    failed = [(p["part"], p["shape"], p.get("traceback") or p.get("log_tail")) for p in report["parts"] if not p["ok"]]  # fmt: skip
    assert not failed, failed
    assert report["_rc"] == 0, report["_stdout"][-3000:]
    assert [(p["part"], p["shape"]) for p in report["parts"]] == [
        ("train", "tiny-llama"),
        ("train", "tiny-qwen2"),
        ("engine", "tiny-llama"),
        ("weights", "tiny-llama"),
        ("math", "tiny-qwen2"),
        ("stack", "tiny-llama"),
    ]
    assert report["device"] == "cpu" and report["dry_run"] is True
    # no failed checkpoint round trip, no error-level event in any service's log
    checked = [p.get("problems") for p in report["parts"] if p["part"] not in ("engine", "weights")]
    assert checked == [[]] * 4


def test_train_steps_are_timed(report):
    for p in _parts(report, "train"):
        assert p["dtype"] == "fp32" and p["device"] == "cpu"
        assert p["step_s"] > 0 and len(p["step_s_all"]) == 1
        # 2 groups x 2 samples of 8 prompt + 8 output tokens
        assert (p["rows"], p["row_tokens"]) == (4, 16)
        # both figures are rounded (step_s to 1e-6 s, tokens/s to 0.1): allow for it
        expected = 64 / p["step_s"]
        assert p["tokens_per_s"] == pytest.approx(expected, rel=2e-6 / p["step_s"], abs=0.051)
        assert p["checkpoint"]["ok"], p["checkpoint"]
        # the load gives back the saved weights, the replayed step the same update (fp32, CPU)
        c = p["checkpoint"]
        assert c["restored_max_abs"] == 0.0 and c["step_max_abs"] > 0.0
        assert c["replayed_max_abs"] == 0.0


def test_engine_interrupt_switches_versions_mid_generation(report):
    [p] = _parts(report, "engine")
    assert p["output_tokens"] == 64 * 64  # every request runs to max_new_tokens
    i = p["interrupt"]
    assert i["interrupted"] == 64 and i["mixed_version_outputs"] == 64 and i["versions_monotone"]
    assert i["interruptions_recorded"] == 64
    # the recorded logprobs are those of the version that sampled each token (fp32)
    assert i["logprob_check"]["tokens"] == 8 * 64  # the first 8 requests
    assert i["logprob_check"]["max_abs"] < 1e-4


def test_weights_reach_both_engines_by_each_transport_against_a_copy_on_the_device(report):
    [p] = _parts(report, "weights")
    assert (p["device"], p["engines"], p["repeats"]) == ("cpu", 2, 1)
    assert list(p["transports"]) == ["disk", "broadcast shm", "broadcast"]  # the CPU's
    assert p["copy_s"] > 0 and p["version_mib"] > 0
    for transport, r in p["transports"].items():
        assert r["serving_s"] >= r["stall_s"] > 0, transport
        assert r["x_copy"] == pytest.approx(r["serving_s"] / p["copy_s"], rel=0.01)
    for transport in ("broadcast shm", "broadcast"):  # the phases of a stream, each timed
        r = p["transports"][transport]
        assert all(r[k] > 0 for k in ("pack_s", "seal_s", "send_s", "receive_s")), r
        assert r["apply_s"] >= 0 and r["sent_mib"] == pytest.approx(p["version_mib"], abs=0.1)
    assert "Weights into two engines" in report["_md"]


def test_math_recipe_runs_its_steps_scored_by_its_reward_ledger_clean(report):
    [p] = _parts(report, "math")
    assert p["spec"] == "examples/math/gpu.yaml"
    assert (p["engine"], p["backend"], p["reward"]) == (
        "torch",
        "megatron",
        "plugin:examples.math.reward:final_answer",
    )
    assert p["experiment_state"] == "COMPLETED" and p["steps"] == 2 and not p["cancelled_at_cap"]
    assert len(p["reward_mean_per_step"]) == 2
    # every sample read back carries final_answer of its text: the recipe's reward scored it
    assert p["samples"] >= 2 * 2 * 2 and p["reward_mismatches"] == 0
    assert p["ledger_clean"] and p["ledger"]["trained_groups"] == 2 * 2
    assert [e["version"] for e in p["evals"]] == [0, 2]  # the recipe's eval, at v0 and the end
    assert "Math recipe" in report["_md"] and "ledger | clean" in report["_md"]


def test_stack_trains_and_measures_the_mismatch(report):
    [p] = _parts(report, "stack")
    assert p["experiment_state"] == "COMPLETED" and p["steps"] == 2
    assert p["groups_read"] >= 2 * 2
    mg = p["mismatch_megatron"]
    assert mg["versions_measured"][0] == 0 and len(mg["versions_measured"]) >= 2
    # 2 samples x 4 tokens per group, every group read back: every token counted once
    assert mg["tokens"] == p["groups_read"] * 2 * 4
    assert mg["mean_abs"] < 1e-4 and p["mismatch_hf_fp32"]["mean_abs"] < 1e-4
    assert "Whole stack" in report["_md"] and "Torch engine" in report["_md"]
