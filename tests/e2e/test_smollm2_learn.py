"""The short version of `make smollm2-learn` (issue 21, point 6): SmolLM2-135M-Instruct through
all four services on its learning task (`examples/smollm2/learn.yaml`: "which number is
larger", chat template, megatron backend, eta = 1), three steps.

It checks what a few steps can show on a real pretrained model:
- the experiment completes with the ledger clean;
- the rollout's logprobs and the trainer's recomputation at the same version agree (the
  mismatch metric near zero: both are fp32 on this CPU, so a gap means a broken weight sync or
  a numerics bug, not noise);
- the trained policy moved the way its loss says it should: over the groups it trained on (the
  ledger's steps), the advantage-weighted logprob of the completions,
  sum_i A_i * mean_t log pi(y_it) with A the trainer's own GRPO advantages (`group_advantages`, the spec's default estimator), is higher
  under the last version's weights than under the initial model (the policy-gradient loss went
  down on its own data).
The full run, 30 minutes against a control, is `make smollm2-learn` (docs/smollm2.md).
"""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from asyncrl import natsutil
from asyncrl.client import read_groups
from asyncrl.ledger import counted_steps, read_events
from examples.smollm2.data import build
from examples.smollm2.fetch import fetch
from services.trainer.algo import token_logprobs
from services.trainer.losses import group_advantages
from tests.e2e.experiment import assert_ledger_clean, run_experiment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
warnings.filterwarnings("ignore")
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
MISMATCH = 1e-3  # mean |logprob diff| on fp32 CPU; measured 8e-6 to 1.5e-5 (docs/smollm2.md)


def learn_spec(model: Path, data: Path) -> dict:
    """examples/smollm2/learn.yaml as committed, shortened: 3 steps of 2 groups, no eval (the
    checks below need none)."""
    spec = yaml.safe_load((ROOT / "examples/smollm2/learn.yaml").read_text())
    spec["model"]["path"] = str(model)
    spec["dataset"]["path"] = str(data / "train.jsonl")
    spec["trainer"].update(total_steps=STEPS, batch_size=2, checkpoint_every=STEPS)
    spec["eval"] = {}
    return spec


def advantage_weighted_logprob(model_dir: Path, groups) -> float:
    """sum over samples of A * (mean logprob of its completion tokens) under `model_dir`, A the
    trainer's own GRPO advantages of the group's rewards. One forward per group: the samples
    are padded on the right, which a causal model's earlier positions never see."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for g in groups:
            advantages = group_advantages(torch.tensor([s.reward for s in g.samples]), "grpo")
            start = len(g.prompt_ids)
            rows = [list(g.prompt_ids) + list(s.output_ids) for s in g.samples]
            width = max(map(len, rows))
            logits = model(torch.tensor([r + [0] * (width - len(r)) for r in rows])).logits
            for i, (row, advantage) in enumerate(zip(rows, advantages.tolist(), strict=True)):
                out = torch.tensor([row[start:]])
                picked = logits[i : i + 1, start - 1 : len(row) - 1]
                total += advantage * token_logprobs(picked, out).mean().item()
    return total


def test_smollm2_three_steps_lower_its_loss_with_no_mismatch(cluster, tmp_path):
    model = fetch(ROOT / "var/models/smollm2-135m")
    build(tmp_path / "data", n_train=200, n_eval=8, seed=0, task="larger")
    exp = asyncio.run(run_experiment(cluster.scheduler, learn_spec(model, tmp_path / "data")))
    assert exp.progress.version == STEPS, exp.message
    assert_ledger_clean(cluster, exp)

    history = sorted(exp.history, key=lambda h: h.version)
    measured = [h for h in history if h.logprob_diff_tokens > 0]
    assert measured, "no step measured the rollout/trainer mismatch"
    assert all(h.logprob_diff_mean < MISMATCH for h in measured), [
        (h.version, h.logprob_diff_mean, h.logprob_diff_max) for h in history
    ]

    async def trained():
        url = f"nats://127.0.0.1:{cluster.nats_port}"
        nc = await natsutil.connect(url)
        try:
            steps = counted_steps(await read_events(nc.jetstream(), exp.id))
        finally:
            await nc.close()
        ids = {g for step in steps for g in step["groups"]}
        return [g async for g in read_groups(exp.id, url) if g.group_id in ids]

    groups = asyncio.run(trained())
    assert len(groups) == STEPS * 2
    assert all(len({s.reward for s in g.samples}) > 1 for g in groups)  # the filter's promise
    last = cluster.var / "weights" / exp.id / f"v{STEPS:06d}"
    before = advantage_weighted_logprob(model, groups)
    after = advantage_weighted_logprob(last, groups)
    assert after > before, (before, after)
