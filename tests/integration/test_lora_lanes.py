"""Several LoRA experiments on one torch engine (docs/lora.md, "Sharing a fleet"): each in its
own lane, with its own versions, fingerprint and eta + 1 adapters; a lane's update never moves
or unloads another lane's requests; requests of both lanes share one batch and each samples
its own adapter token for token. Real tiny model, real peft adapters as the trainer publishes
them."""

from __future__ import annotations

import asyncio
import dataclasses

from services.rollout.engine import GenRequest
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
