"""Several LoRA experiments on one torch engine (docs/lora.md, "Sharing a fleet"): each in its
own lane, with its own versions, fingerprint and eta + 1 adapters; a lane's update never moves
or unloads another lane's requests; requests of both lanes share one batch and each samples
its own adapter token for token. Real tiny model, real peft adapters as the trainer publishes
them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

from asyncrl.weights import path_to_uri
from services.rollout.engine import GenRequest
from services.rollout.service import GroupJob, RolloutService
from services.rollout.torch_engine import TorchEngine
from tests.integration.test_lora import base, greedy, peft_greedy, peft_model, publish

__all__ = ["base"]  # the module fixture, shared


def in_lane(req: GenRequest, lane: str) -> GenRequest:
    return dataclasses.replace(req, lane=lane)


async def test_lanes_sample_their_own_adapter_and_update_apart(tmp_path, base):
    a1, b1, a2 = (peft_model(base, seed=s) for s in (1, 2, 3))
    (da1, fa1), (db1, fb1) = (
        publish(tmp_path / "a", base, 1, a1),
        publish(tmp_path / "b", base, 1, b1),
    )
    da2, _ = publish(tmp_path / "a", base, 2, a2)
    engine = TorchEngine(seed=0)  # adapter_update=interrupt: an update moves its lane's requests
    await engine.start()
    try:
        await engine.load(str(base), 0)
        assert await engine.update_weights(str(base), 0, lane="b") == 0  # b starts on the base
        assert await engine.update_weights(da1, 1, lane="a", keep=2) == 0
        assert await engine.update_weights(db1, 1, lane="b", keep=2) == 0
        assert (engine.version_of("a"), engine.fingerprint_of("a")) == (1, fa1)
        assert (engine.version_of("b"), engine.fingerprint_of("b")) == (1, fb1)
        prompt = [5, 9, 12, 7]
        # both lanes in one batch, each greedy token for token its own adapted model's
        got_a, got_b = await engine.generate_many(
            [in_lane(greedy("a", prompt), "a"), in_lane(greedy("b", prompt), "b")]
        )
        assert got_a.output_ids == peft_greedy(a1, prompt, 8)
        assert got_b.output_ids == peft_greedy(b1, prompt, 8) != got_a.output_ids
        # b's long request runs while a takes v2 and v3: b's is not moved, a's is
        long_b = asyncio.create_task(engine.generate(in_lane(greedy("lb", prompt, n=60), "b")))
        long_a = asyncio.create_task(engine.generate(in_lane(greedy("la", prompt, n=60), "a")))
        while engine.tokens_generated < 20:
            await asyncio.sleep(0.001)
        assert await engine.update_weights(da2, 2, lane="a", keep=2) == 1  # long_a only
        assert await engine.update_weights(da1, 3, lane="a", keep=2) == 1
        done_b, done_a = await long_b, await long_a
        assert done_b.versions == [1] * 60 and done_b.interruptions == 0
        assert done_b.output_ids == peft_greedy(b1, prompt, 60)
        assert done_a.interruptions == 2 and done_a.versions[-1] == 3
        # a keeps 2 versions (2, 3): its third unloaded v1 of a, not b's v1
        assert [k for k in engine.adapters.loaded] == [("b", 1), ("a", 2), ("a", 3)]
        assert engine.version_of("b") == 1 and engine.version_of("a") == 3
    finally:
        await engine.stop()


def lora_spec_json(base) -> str:
    return json.dumps(
        {
            "model": {"path": str(base)},
            "dataset": {"path": "unused-by-the-rollout.jsonl"},
            "rollout": {
                "n_samples": 2,
                "max_head_offpolicyness": 1,
                "filter": "none",
                "gconfig": {"temperature": 0.0, "max_new_tokens": 60, "ignore_eos": True},
            },
            "trainer": {"backend": "torch", "lora": {"rank": 4, "alpha": 8.0}},
        }
    )


async def test_service_binds_a_second_lora_experiment_beside_the_first(tmp_path, base):
    """The rollout service: binding b beside a leaves a's group running; b's three
    UpdateWeights move none of a's requests (every token of a's samples is a's v1);
    each answers its own lane's fingerprint; a full-parameter bind then replaces both."""
    (da1, fa1) = publish(tmp_path / "a", base, 1, peft_model(base, seed=1))
    (db1, _), (db2, fb2) = (
        publish(tmp_path / "b", base, v, peft_model(base, seed=v + 1)) for v in (1, 2)
    )
    engine = TorchEngine(seed=0)
    await engine.start()
    service = RolloutService(engine, js=None, weights_cache=tmp_path / "cache")
    try:
        spec = lora_spec_json(base)
        await service.bind("a", spec)
        assert (await service.update_weights("a", 1, path_to_uri(Path(da1)))).fingerprint == fa1
        job = GroupJob("a", "a-g1", "p1", "1+1=", "2")
        binding = service.bindings["a"]
        prompt_ids, chat = service._prompt(job, binding)
        group = asyncio.create_task(service._samples(job, binding, prompt_ids, chat))
        while engine.tokens_generated < 10:
            await asyncio.sleep(0.001)
        await service.bind("b", spec)  # beside a
        moved = [await service.update_weights("b", 0, path_to_uri(base))]
        for version, d in ((1, db1), (2, db2)):
            moved.append(await service.update_weights("b", version, path_to_uri(Path(d))))
        assert [r.interrupted for r in moved] == [0, 0, 0] and moved[-1].fingerprint == fb2
        samples = await group
        assert all(s.versions == [1] * 60 for s in samples)  # moved by b: 2 for the rest
        assert service.experiment_id == "a,b" and not group.cancelled()
        full = json.loads(spec)
        del full["trainer"]["lora"]
        await service.bind("c", json.dumps(full))  # a full-parameter one: instead of both
        assert list(service.bindings) == ["c"] and service.loaded == {}
    finally:
        await engine.stop()
