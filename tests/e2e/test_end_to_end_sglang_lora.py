"""A short LoRA experiment (`trainer.lora`) through all four services on the SGLang engine
(its HTTP fake as the managed child, as strict as SGLang on LoRA: tests/fakes/sglang_lora.py):
the child is launched with the experiment's LoRA flags, every version reaches it as an adapter
by `/load_lora_adapter`, the samples name the adapter that made them, and the run completes
with the ledger clean. The torch engine's run: test_end_to_end_lora.py."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from tests.e2e.experiment import (
    assert_completed,
    assert_dump_decodes,
    assert_ledger_clean,
    run_experiment,
    sglang_children,
    small_spec,
    start_cluster,
)

pytestmark = pytest.mark.timeout(900)

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from start_cluster(tmp_path_factory.mktemp("var"), engine="sglang")


def test_lora_experiment_with_sglang_engine_completes(cluster, task, tmp_path):
    spec = small_spec(task, engine="sglang", lr=1e-2, lora=LORA)
    exp = asyncio.run(run_experiment(cluster.scheduler, spec))
    assert_completed(exp)
    assert_dump_decodes(cluster, exp, tmp_path / "traj.jsonl")
    assert_ledger_clean(cluster, exp)

    child = sglang_children(cluster)[-1]
    cmd = child["cmd"].split()
    assert cmd[cmd.index("--max-lora-rank") + 1] == "4" and "--enable-lora" in cmd
    with urllib.request.urlopen(f"{child['url']}/fake_calls", timeout=10) as r:
        calls = json.load(r)
    loads = [c["body"] for c in calls if c["path"] == "/load_lora_adapter"]
    store = cluster.var / "weights" / exp.id
    versions = {int(p.name[1:]) for p in store.glob("v*")}
    loaded = {int(b["lora_path"].rstrip("/").rsplit("/v", 1)[1]) for b in loads}
    assert versions and versions <= loaded  # each stored version went in as an adapter
    named = {c["body"].get("lora_path") for c in calls if c["path"] == "/generate"}
    assert {b["lora_name"] for b in loads} & named  # samples ran under the adapters
    assert not [c for c in calls if c["path"] == "/update_weights_from_disk"]
