"""A short LoRA experiment (`trainer.lora`) through all four services on the torch engine,
started the way `make up` starts them: it completes with the ledger clean, every version in the
weight store is an adapter (no full model), the rollouts sampled under the adapters the trainer
committed (the samples' fingerprints are the versions' manifests), and the trainer's checkpoints
hold the adapter alone. The shared parts are in experiment.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl import fingerprint
from tests.e2e.experiment import (
    assert_completed,
    assert_dump_decodes,
    assert_ledger_clean,
    run_experiment,
    small_spec,
)

pytestmark = pytest.mark.timeout(900)

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}


def test_lora_experiment_completes_through_all_services(cluster, task, tmp_path):
    spec = small_spec(task, lr=1e-2, lora=LORA)
    exp = asyncio.run(run_experiment(cluster.scheduler, spec))
    assert_completed(exp)
    out = tmp_path / "traj.jsonl"
    assert_dump_decodes(cluster, exp, out)
    assert_ledger_clean(cluster, exp)

    store = cluster.var / "weights" / exp.id
    versions = sorted(store.glob("v*"))
    assert versions and versions[-1].name == "v000004"
    manifests = {}
    for d in versions:
        names = {p.name for p in d.iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json"} <= names, names
        assert "model.safetensors" not in names
        manifests[int(d.name[1:])] = fingerprint.read_manifest(d)
        assert manifests[int(d.name[1:])] == fingerprint.of_dir(d)
    # the trainer committed each version with its adapter's fingerprint, and the fleet took
    # every one: the rollout proved it holds that adapter (no rollout fenced)
    commits = {
        e["version"]: e["fingerprint"]
        for e in cluster.events("scheduler", "version_committed")
        if e["experiment"] == exp.id
    }
    assert sorted(commits) == [1, 2, 3, 4]
    assert all(commits[v] == fp for v, fp in manifests.items())
    updates = [e for e in cluster.events("scheduler", "fleet_updated") if e["experiment"] == exp.id]
    assert updates and all(e["fenced"] == 0 and e["updated"] == 1 for e in updates)
    applied = cluster.events("rollout", "weights_applied")
    assert {e["version"] for e in applied if e["kind"] == "adapter"} >= {v for v in manifests}
    ckpts = sorted((cluster.var / "checkpoints" / exp.id).glob("step_*"))
    state = torch.load(ckpts[-1] / "backend" / "model.pt")
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state)
