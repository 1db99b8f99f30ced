"""`asyncrl export`: a short experiment through all four services (started as `make up` starts
them), then its final version exported and loaded with transformers, whose greedy tokens must
equal those the rollout engine generated at that version (the final eval round, temperature
0, every token of the final version). The same for a LoRA run, merged and adapter-only."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from asyncrl.cli import app as cli_app
from asyncrl.client import read_groups
from asyncrl.fingerprint import read_manifest
from asyncrl.weights import tokenizer_files, uri_to_path
from tests.e2e.experiment import (
    TOTAL_STEPS,
    assert_completed,
    run_experiment,
    small_spec,
)

pytestmark = pytest.mark.timeout(900)

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}


def cli(cluster, *args: str):
    result = CliRunner().invoke(cli_app, ["--scheduler", cluster.scheduler, *args])
    return result.exit_code, result.output


def final_eval_samples(cluster, exp) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) of the eval samples generated wholly by the final version."""

    async def go():
        url = f"nats://127.0.0.1:{cluster.nats_port}"
        return [g async for g in read_groups(exp.id, url, include_eval=True) if g.eval]

    found = [
        (g.prompt_ids, s.output_ids)
        for g in asyncio.run(go())
        for s in g.samples
        if s.output_ids and set(s.versions) == {TOTAL_STEPS}
    ]
    assert found, "no eval sample of the final version"
    return found


@torch.no_grad()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def assert_same_greedy(model, samples) -> None:
    model.eval()
    for prompt, output in samples:
        assert greedy(model, prompt, len(output)) == output, (prompt, output)


def test_export_full_model_loads_with_engine_greedy_tokens(cluster, task, tmp_path):
    model_dir = task[0]
    exp = asyncio.run(run_experiment(cluster.scheduler, small_spec(task)))
    assert_completed(exp)
    assert exp.weights_version == TOTAL_STEPS and exp.weights_uri.startswith("file://")

    code, text = cli(cluster, "status", exp.id)
    assert code == 0 and f"weights: v{TOTAL_STEPS} at file://" in text, text

    out = tmp_path / "exported"
    code, text = cli(cluster, "export", exp.id, "--out", str(out))
    assert code == 0, text
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "asyncrl_export.json"} <= names
    assert set(tokenizer_files(model_dir)) <= names  # every tokenizer file the base had
    provenance = json.loads((out / "asyncrl_export.json").read_text())
    assert provenance["version"] == TOTAL_STEPS
    stored = read_manifest(uri_to_path(exp.weights_uri))
    assert provenance["fingerprint"] == stored and stored.startswith("xxh3/")  # broadcast's

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32  # the base's dtype (the tiny model is fp32)
    AutoTokenizer.from_pretrained(out)
    assert_same_greedy(model, final_eval_samples(cluster, exp))

    code, text = cli(cluster, "export", exp.id, "--out", str(out))
    assert code == 2 and "not empty" in text
    code, text = cli(cluster, "export", exp.id, "--version", "9", "--out", str(tmp_path / "x"))
    assert code == 2 and "versions 0..4" in text
    code, text = cli(cluster, "export", exp.id, "--version", "2", "--out", str(tmp_path / "v2"))
    assert code == 0, text
    assert json.loads((tmp_path / "v2" / "asyncrl_export.json").read_text())["version"] == 2


def test_export_lora_merged_and_adapter_only(cluster, task, tmp_path):
    from peft import PeftModel

    model_dir = task[0]
    exp = asyncio.run(run_experiment(cluster.scheduler, small_spec(task, lr=1e-2, lora=LORA)))
    assert_completed(exp)
    samples = final_eval_samples(cluster, exp)

    merged = tmp_path / "merged"
    code, text = cli(cluster, "export", exp.id, "--out", str(merged))
    assert code == 0, text
    assert not (merged / "adapter_config.json").exists()
    assert_same_greedy(AutoModelForCausalLM.from_pretrained(merged), samples)

    adapter = tmp_path / "adapter"
    code, text = cli(cluster, "export", exp.id, "--adapter-only", "--out", str(adapter))
    assert code == 0, text
    names = {p.name for p in adapter.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names
    assert "model.safetensors" not in names
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert_same_greedy(PeftModel.from_pretrained(base, str(adapter)), samples)
