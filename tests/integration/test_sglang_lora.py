"""LoRA on the SGLang engine, against the HTTP fake (as strict as SGLang 0.5.23 on LoRA:
tests/fakes/sglang_lora.py) with real tiny models and real peft adapters: an adapter version
changes what the engine samples to what peft's adapted model samples, an update mid-generation
moves the request to the new adapter with per-token versions, old adapters are unloaded, a
launched child gets the experiment's LoRA flags, and every call passes sglang's own checks."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from asyncrl.spec import LoraSpec
from asyncrl.tiny import build_tiny_model
from services.rollout.sglang_config import SGLangConfig
from services.rollout.sglang_engine import SGLangEngine, SGLangError
from services.rollout.sglang_process import LaunchConfig, build_command
from tests import sglang_contract as sg
from tests.fakes.sglang_lora import LoraFlags
from tests.fakes.sglang_server import fake_launch_cmd, serve_fake
from tests.lora_models import greedy, peft_greedy, peft_model, publish

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

LORA = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
FLAGS = LoraFlags(max_rank=8, target_modules=("q_proj", "k_proj", "v_proj", "down_proj"))
PROMPT = [5, 9, 12, 7]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base") / "model"
    build_tiny_model(d, seed=0)
    return d


async def attached(fake, keep: int = 2) -> SGLangEngine:
    engine = SGLangEngine(SGLangConfig(url=fake.url))
    await engine.start()
    engine.serve_lora(LORA, keep)
    await engine.load(fake.model_path, 0)
    return engine


async def test_adapter_update_changes_what_sglang_samples(tmp_path, base):
    """After an adapter update the engine samples, greedily and token for token, what peft's
    adapted model does (verl #7495: an adapter that never reached the engine shows)."""
    model = peft_model(base, seed=3, spec=LORA)
    d, _ = publish(tmp_path, base, 1, model)
    async with serve_fake(base, lora=FLAGS, return_original_logprob=True) as fake:
        engine = await attached(fake)
        try:
            before = await engine.generate(greedy("a", PROMPT))
            assert await engine.update_weights(d, 1) == 0
            after = await engine.generate(greedy("b", PROMPT))
        finally:
            await engine.stop()
        assert after.output_ids == peft_greedy(model, PROMPT, 8) != before.output_ids
        assert after.versions == [1] * 8 and before.versions == [0] * 8
        tok = fake.tokenizer
        paths = [c["path"] for c in fake.calls]
        for call in fake.calls:
            if call["path"] == "/generate":
                sg.check_generate(call["body"], tok, fake.model.config.vocab_size, fake.context)
            elif call["method"] == "POST":
                sg.check_control(call["path"], call["body"])
        assert "/load_lora_adapter" in paths
        named = [c["body"].get("lora_path") for c in fake.calls if c["path"] == "/generate"]
        assert named == [None, engine.adapters.current]


async def test_update_mid_generation_moves_the_request_to_the_new_adapter(tmp_path, base):
    d1, _ = publish(tmp_path, base, 1, peft_model(base, seed=1, spec=LORA))
    d2, _ = publish(tmp_path, base, 2, peft_model(base, seed=2, spec=LORA))
    async with serve_fake(base, lora=FLAGS, token_delay_s=0.01) as fake:
        engine = await attached(fake, keep=1)
        try:
            await engine.update_weights(d1, 1)
            long = asyncio.create_task(engine.generate(greedy("long", [5, 9, 12], n=60)))
            while fake.stats["tokens"] < 5:
                await asyncio.sleep(0.005)
            moved = await engine.update_weights(d2, 2)
            short = await engine.generate(greedy("short", [5, 9, 12], n=4))
            done = await long
        finally:
            await engine.stop()
        assert moved == 1 and done.interruptions == 1 and short.versions == [2] * 4
        switch = done.versions.index(2)
        assert 5 <= switch < 60 and done.versions == [1] * switch + [2] * (60 - switch)
        assert list(fake.adapters) == [engine.adapters.current]  # keep=1: v1 unloaded
        assert engine.adapters.version == 2


async def test_a_rewound_version_is_loaded_under_a_new_name(tmp_path, base):
    """SGLang refuses a name in use: version 1 published again (a rewind) gets a new one."""
    d1, _ = publish(tmp_path / "a", base, 1, peft_model(base, seed=1, spec=LORA))
    again, _ = publish(tmp_path / "b", base, 1, peft_model(base, seed=5, spec=LORA))
    async with serve_fake(base, lora=FLAGS) as fake:
        engine = await attached(fake, keep=2)
        try:
            await engine.update_weights(d1, 1)
            first = engine.adapters.current
            await engine.update_weights(again, 1)
            assert engine.adapters.current != first
            assert fake.adapters == {first: d1, engine.adapters.current: again}
        finally:
            await engine.stop()


async def test_server_without_enable_lora_fails_the_update_with_its_reason(tmp_path, base):
    d, _ = publish(tmp_path, base, 1, peft_model(base, seed=1, spec=LORA))
    async with serve_fake(base) as fake:
        engine = await attached(fake)
        try:
            with pytest.raises(SGLangError, match="LoRA is not enabled"):
                await engine.update_weights(d, 1)
            after = await engine.generate(greedy("c", PROMPT))  # still serving the base
            assert after.versions == [0] * 8
        finally:
            await engine.stop()


async def test_launched_child_gets_the_experiments_lora_flags(tmp_path, base):
    model = peft_model(base, seed=3, spec=LORA)
    d, _ = publish(tmp_path, base, 1, model)
    launch = LaunchConfig(launch_cmd=fake_launch_cmd(), log_path=str(tmp_path / "child.log"))
    engine = SGLangEngine(SGLangConfig(launch=launch, sglang_version="0.5.23"))
    await engine.start()
    try:
        engine.serve_lora(None, 3)  # a full-parameter experiment on the same base first
        await engine.load(str(base), 0)
        engine.serve_lora(LORA, 3)  # then a LoRA one: launched again, with the flags
        await engine.load(str(base), 0)
        argv = build_command(engine.process.cfg, engine.api.version)  # the child's argv
        assert argv[argv.index("--enable-lora") :][:2] == ["--enable-lora", "--max-lora-rank"]
        fields = ["model_path", "host", "port", "tp_size", "mem_fraction_static", "random_seed"]
        fields += ["skip_server_warmup", "weight_version", "enable_lora", "max_lora_rank"]
        fields += ["lora_target_modules", "max_loras_per_batch"]
        parsed = sg.parse_launch_args(argv[3:], fields)
        assert parsed["enable_lora"] is True and parsed["max_lora_rank"] == 4
        assert parsed["lora_target_modules"] == ["q_proj", "v_proj", "down_proj"]
        assert parsed["max_loras_per_batch"] == 4
        await engine.update_weights(d, 1)
        out = await engine.generate(greedy("d", PROMPT))
        assert out.output_ids == peft_greedy(model, PROMPT, 8) and out.versions == [1] * 8
    finally:
        await engine.stop()


# ----------------------------------------------------------------- the fake is as strict
async def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.json()


async def test_fake_refuses_what_sglang_refuses(tmp_path, base):
    d, _ = publish(tmp_path, base, 1, peft_model(base, seed=1, spec=LORA))
    big = LoraSpec(rank=16, alpha=8.0, target_modules=["q_proj"])
    d_big, _ = publish(tmp_path / "big", base, 1, peft_model(base, seed=1, spec=big))
    async with serve_fake(base) as plain:
        status, body = await post(
            plain.url, "/load_lora_adapter", {"lora_name": "x", "lora_path": d}
        )
        assert status == 400 and "LoRA is not enabled" in body["error_message"]
        status, body = await post(plain.url, "/generate", {"input_ids": PROMPT, "lora_path": "x"})
        assert status == 400 and "--enable-lora" in body["error"]["message"]
    async with serve_fake(base, lora=FLAGS) as fake:
        assert (await post(fake.url, "/load_lora_adapter", {"lora_name": "x"}))[0] == 422
        assert (await post(fake.url, "/load_lora_adapter", {"lora_name": "x", "lora_path": d}))[
            0
        ] == 200
        status, body = await post(
            fake.url, "/load_lora_adapter", {"lora_name": "x", "lora_path": d}
        )
        assert status == 400 and "already loaded" in body["error_message"]
        status, body = await post(
            fake.url, "/load_lora_adapter", {"lora_name": "y", "lora_path": d_big}
        )
        assert status == 400 and "incompatible" in body["error_message"]
        status, body = await post(fake.url, "/generate", {"input_ids": PROMPT, "lora_path": "z"})
        assert status == 400 and "never been loaded" in body["error"]["message"]
        status, body = await post(fake.url, "/unload_lora_adapter", {"lora_name": "z"})
        assert status == 400 and "does not exist" in body["error_message"]
        assert (await post(fake.url, "/unload_lora_adapter", {"lora_name": "x"}))[0] == 200
        # a name unloaded since is loaded again from its path, as SGLang does
        status, _ = await post(fake.url, "/generate", {"input_ids": PROMPT, "lora_path": "x"})
        assert status == 200 and list(fake.adapters) == ["x"]


async def test_fake_unload_waits_for_the_requests_running_under_the_adapter(tmp_path, base):
    d, _ = publish(tmp_path, base, 1, peft_model(base, seed=1, spec=LORA))
    async with serve_fake(base, lora=FLAGS, token_delay_s=0.01) as fake:
        await post(fake.url, "/load_lora_adapter", {"lora_name": "x", "lora_path": d})
        sampling = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0.0}
        body = {"input_ids": PROMPT, "lora_path": "x", "sampling_params": sampling}
        order: list[str] = []
        running = asyncio.create_task(post(fake.url, "/generate", body))
        running.add_done_callback(lambda _: order.append("generate"))
        while fake.stats["tokens"] < 3:
            await asyncio.sleep(0.005)
        unload = asyncio.create_task(post(fake.url, "/unload_lora_adapter", {"lora_name": "x"}))
        unload.add_done_callback(lambda _: order.append("unload"))
        (status, answer), (unloaded, _) = await asyncio.gather(running, unload)
        assert status == 200 and unloaded == 200 and order == ["generate", "unload"]
        assert answer["meta_info"]["completion_tokens"] == 40  # finished under x, not cut
