"""`trainer.weight_sync: nccl` into the SGLang fake (its own process, gloo on loopback): the
trainer's broadcaster sends a version from its tensors in packed buckets, the engine reads the
plan from the trainer's store and asks for one `flattened_bucket` per bucket. The served
weights are the trainer's bit for bit, one broadcast moved each bucket, and a misaligned
bucket is refused before any broadcast, as SGLang's `FlattenedTensorBucket` refuses it. A
server older than flattened buckets is refused by the engine before any update call."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
import torch

from asyncrl import buckets
from asyncrl.net import free_port
from asyncrl.tiny import build_tiny_model
from asyncrl.weights import load_state_dict_files
from services.rollout.sglang_config import SGLangConfig
from services.rollout.sglang_engine import SGLangEngine, SGLangError
from services.trainer.weight_sync import WeightBroadcaster
from tests import sglang_contract as sg
from tests.fakes.sglang_server import serve_fake, spawn_fake, tensor_digest

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

BUCKET_BYTES = 16 << 10


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("sglang-buckets")
    for version in (0, 1):
        build_tiny_model(root / f"v{version}", seed=version)
    return {v: str(root / f"v{v}") for v in (0, 1)}


async def _get(url: str, path: str):
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return await r.json()


async def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.json()


async def test_flattened_buckets_serve_the_trainers_weights_one_broadcast_per_bucket(models):
    port = free_port()
    state = {k: v + 0.5 for k, v in load_state_dict_files(models[1]).items()}  # not on disk
    plan = buckets.plan_of_state(state, BUCKET_BYTES, packed=True)
    assert 1 < len(plan.sizes) < len(state)
    with spawn_fake(models[0], "--weight-version", "0", "--sglang-version", sg.version()) as url:
        engine = SGLangEngine(
            SGLangConfig(
                url=url, weight_sync="nccl", nccl_master=f"127.0.0.1:{port}", nccl_backend="gloo"
            )
        )
        await engine.start()
        try:
            await engine.load(models[0], 0)
            sender = WeightBroadcaster(
                "127.0.0.1", port, world_size=2, backend="gloo", bucket_bytes=BUCKET_BYTES
            )
            thread = threading.Thread(target=sender.send_state, args=(1, state))
            thread.start()
            await engine.update_weights("/not/read", 1)
            await asyncio.to_thread(thread.join, 60)
            served = await _get(url, "/fake_weights")
            stats = await _get(url, "/fake_stats")
            calls = await _get(url, "/fake_calls")
            misaligned = {  # int8 of 3 bytes, then a float32 at byte 3
                "names": list(state)[:2],
                "dtypes": ["int8", "float32"],
                "shapes": [[3], [1]],
                "group_name": "asyncrl-weights",
                "load_format": "flattened_bucket",
            }
            await _post(url, "/begin_weight_update", {})
            refused = await _post(url, "/update_weights_from_distributed", misaligned)
            await _post(url, "/end_weight_update", {})
            after = await _get(url, "/fake_stats")
            sender.close()
        finally:
            await engine.stop()
    assert engine.version == 1
    assert {k: served[k] for k in state} == {k: tensor_digest(v) for k, v in state.items()}
    updates = [c for c in calls if c["path"] == "/update_weights_from_distributed"]
    assert stats["broadcasts"] == sender.broadcasts == len(updates) == len(plan.sizes)
    assert all(c["body"]["load_format"] == "flattened_bucket" for c in updates)
    assert refused[0] == 400 and refused[1]["message"] == (
        "Failed to receive weights: Unaligned received tensor "
        f"{misaligned['names'][1]}: byte offset 3, dtype {torch.float32}"
    )
    assert after["broadcasts"] == stats["broadcasts"]  # refused before any broadcast


async def test_nccl_update_of_a_server_without_flattened_buckets_fails_before_any_call(models):
    async with serve_fake(models[0], sglang_version="0.5.5") as fake:
        engine = SGLangEngine(
            SGLangConfig(url=fake.url, weight_sync="nccl", nccl_master="127.0.0.1:1")
        )
        await engine.start()
        try:
            await engine.load(models[0], 0)
            fake.calls.clear()
            with pytest.raises(SGLangError, match="from 0.5.6 on; this server is 0.5.5"):
                await engine.update_weights(models[1], 1)
        finally:
            await engine.stop()
    assert engine.version == 0
    assert "/update_weights_from_distributed" not in [c["path"] for c in fake.calls]
