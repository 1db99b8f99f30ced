"""LoRA end to end below the services: the torch backend trains a peft adapter on a frozen base
and publishes it alone; the torch engine's `AdapterBank` applies it per request, several in one
batch, and what it samples changes with the adapter. Real tiny models, real peft, the trainer's
own `write_version` (the weight store and its fingerprint manifest)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl import fingerprint
from asyncrl.spec import LoraSpec
from asyncrl.tiny import build_tiny_model
from services.rollout.adapters import AdapterBank, read_adapter
from services.rollout.torch_engine import TorchEngine
from services.trainer import lora
from tests.lora_models import EXP, LORA, greedy, peft_greedy, peft_model, publish


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base") / "model"
    build_tiny_model(d, seed=0)
    return d


def test_version_is_the_adapter_alone_and_its_fingerprint_is_the_engines(tmp_path, base):
    model = peft_model(base, seed=1)
    files = lora.adapter_files(model)
    assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors"]
    d, fp = publish(tmp_path, base, 1, model)
    assert not (tmp_path / EXP / "v000001" / "model.safetensors").exists()
    adapter = read_adapter(d)
    # 2 layers x 3 modules x (A, B); the engine's fingerprint over what it read is the manifest's
    assert len(adapter.weights) == 6 and adapter.rank == 4 and adapter.scale == 8.0 / 4
    assert adapter.fingerprint == fp == fingerprint.of_files(files)


@torch.no_grad()
def test_bank_mixed_batch_equals_each_adapter_alone(tmp_path, base):
    """Three rows, one forward: the base, adapter 1, adapter 2; each row's logits are the ones
    peft's own model gives for that adapter (and the base's for row 0)."""
    one, two = peft_model(base, seed=1), peft_model(base, seed=2)
    d1, _ = publish(tmp_path, base, 1, one)
    d2, _ = publish(tmp_path, base, 2, two)
    engine_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    bank = AdapterBank(engine_model, capacity=2)
    bank.add(1, read_adapter(d1))
    bank.add(2, read_adapter(d2))
    ids = torch.tensor([[5, 9, 12, 7, 3]] * 3)
    with bank.rows([0, bank.slot(1), bank.slot(2)]):
        mixed = engine_model(input_ids=ids).logits
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    expected = [plain(input_ids=ids[:1]).logits, one(input_ids=ids[:1]).logits]
    expected.append(two(input_ids=ids[:1]).logits)
    for row, want in enumerate(expected):
        torch.testing.assert_close(mixed[row : row + 1], want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected[1], expected[0], atol=1e-2)  # the adapters matter
    # capacity 2: a third adapter unloads the oldest
    assert bank.add(3, read_adapter(d1)) == [1] and bank.slot(1) == 0 and bank.slot(3) == 2


@torch.no_grad()
def test_bank_pads_adapters_of_other_ranks_and_modules(tmp_path, base):
    """Rank 4 on q/v/down beside rank 2 on k/o/up in one forward: each row is its own adapter
    (a zero-padded rank adds nothing; a module one adapter lacks gets no delta from it)."""
    other = LoraSpec(rank=2, alpha=3.0, target_modules=["k_proj", "o_proj", "up_proj"])
    one, two = peft_model(base, seed=4), peft_model(base, seed=5, spec=other)
    d1, _ = publish(tmp_path, base, 1, one)
    d2, _ = publish(tmp_path, base, 2, two)
    engine_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    bank = AdapterBank(engine_model, capacity=2)
    bank.add(1, read_adapter(d1))
    bank.add(2, read_adapter(d2))
    ids = torch.tensor([[3, 8, 13, 21]] * 2)
    with bank.rows([bank.slot(2), bank.slot(1)]):
        mixed = engine_model(input_ids=ids).logits
    torch.testing.assert_close(mixed[:1], two(input_ids=ids[:1]).logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[1:], one(input_ids=ids[:1]).logits, rtol=1e-5, atol=1e-5)


def test_read_adapter_refuses_what_the_bank_cannot_apply(tmp_path, base):
    import json

    d, _ = publish(tmp_path, base, 1, peft_model(base, seed=1))
    config = json.loads((tmp_path / EXP / "v000001" / "adapter_config.json").read_text())
    (tmp_path / EXP / "v000001" / "adapter_config.json").write_text(
        json.dumps(config | {"use_dora": True})
    )
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        read_adapter(d)


async def test_adapter_update_changes_what_the_engine_samples(tmp_path, base):
    """The verl #7495 failure cannot pass silently: after an adapter update the engine samples
    what the adapted model would (greedy, token for token), not the base."""
    model = peft_model(base, seed=3)
    d, fp = publish(tmp_path, base, 1, model)
    engine = TorchEngine(seed=0)
    await engine.start()
    try:
        await engine.load(str(base), 0)
        prompt = [5, 9, 12, 7]
        before = await engine.generate(greedy("a", prompt))
        assert await engine.update_weights(d, 1) == 0
        after = await engine.generate(greedy("b", prompt))
        assert engine.version == 1 and engine.fingerprint == fp
        assert after.output_ids == peft_greedy(model, prompt, 8) != before.output_ids
        assert after.versions == [1] * 8 and before.versions == [0] * 8
    finally:
        await engine.stop()


async def _two_versions_in_flight(tmp_path, base, mode: str, keep: int = 2):
    """A long request starts under adapter 1; adapter 2 arrives mid-generation; a short one
    starts under 2. Returns (long, short) completions."""
    d1, _ = publish(tmp_path, base, 1, peft_model(base, seed=1))
    d2, _ = publish(tmp_path, base, 2, peft_model(base, seed=2))
    engine = TorchEngine(seed=0, adapter_update=mode)
    engine.adapter_keep = keep
    await engine.start()
    try:
        await engine.load(str(base), 0)
        await engine.update_weights(d1, 1)
        long = asyncio.create_task(engine.generate(greedy("long", [5, 9, 12], n=60)))
        while engine.tokens_generated < 5:
            await asyncio.sleep(0.001)
        moved = await engine.update_weights(d2, 2)
        short = await engine.generate(greedy("short", [5, 9, 12], n=4))
        return await long, short, moved
    finally:
        await engine.stop()


async def test_finish_mode_request_ends_under_its_version_beside_the_new_one(tmp_path, base):
    long, short, moved = await _two_versions_in_flight(tmp_path, base, "finish")
    assert moved == 0 and long.interruptions == 0
    assert long.versions == [1] * 60 and short.versions == [2] * 4


async def test_interrupt_mode_resumes_under_the_new_adapter_versions_in_order(tmp_path, base):
    long, short, moved = await _two_versions_in_flight(tmp_path, base, "interrupt")
    assert moved == 1 and long.interruptions == 1 and short.versions == [2] * 4
    switch = long.versions.index(2)
    assert 5 <= switch < 60 and long.versions == [1] * switch + [2] * (60 - switch)


async def test_finish_mode_unloaded_adapter_moves_its_request_to_the_newest(tmp_path, base):
    long, _, moved = await _two_versions_in_flight(tmp_path, base, "finish", keep=1)
    assert moved == 1 and long.interruptions == 1 and long.versions[-1] == 2


def test_backend_trains_the_adapter_only_and_checkpoints_it(tmp_path, base):
    """A step moves the adapter and nothing of the base; the KL reference is the base (kl 0
    before the first update); a checkpoint holds the adapter and its optimizer only, and a
    restored backend's next step is bit-identical to the uninterrupted one's."""
    from tests.integration.test_torch_backend import make_backend, make_groups, on_policy

    kw = dict(lora=LORA.model_dump(), minibatches=2, kl_coef=0.05, weight_decay=0.01)
    straight = make_backend(str(base), **kw)
    assert straight.ref_model is None  # no copy of the model: the adapter disabled instead
    frozen = {k: v.clone() for k, v in straight.model.named_parameters() if "lora_" not in k}
    start = lora.model_state(straight.model)
    first = straight.train_step(on_policy(straight, make_groups(10)))
    assert first["kl"] > 0  # minibatch 2 runs after one update of the adapter
    moved = lora.model_state(straight.model)
    assert any(not torch.equal(start[k], moved[k]) for k in moved)
    params = dict(straight.model.named_parameters())
    assert all(torch.equal(v, params[k]) for k, v in frozen.items())
    files = straight.hf_files()
    assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors"]
    straight.save_checkpoint(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt" / "model.pt")
    assert sorted(saved) == sorted(moved) and all("lora_" in k for k in saved)
    want = straight.train_step(on_policy(straight, make_groups(11)))

    resumed = make_backend(str(base), **kw)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.hf_files() == files and resumed.steps == 1
    got = resumed.train_step(on_policy(resumed, make_groups(11)))
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    a, b = lora.model_state(straight.model), lora.model_state(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
