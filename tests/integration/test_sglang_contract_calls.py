"""Every HTTP call a real SGLangEngine run makes, checked against the installed `sglang`
package (tests/sglang_contract.py): the fake records the calls, each /generate body goes
through sglang's schema, SamplingParams and context checks, each control body through its
io_struct type, and the fake's answers decode with sglang's api_types. The collective update
runs inside the weight-update session SGLang 0.5.21+ requires."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest

from asyncrl import buckets
from asyncrl.net import free_port
from asyncrl.spec import SamplingParams
from asyncrl.tiny import build_tiny_model
from asyncrl.weights import load_state_dict_files
from services.rollout.engine import GenRequest
from services.rollout.sglang_config import SGLangConfig
from services.rollout.sglang_engine import SGLangEngine, SGLangError, error_message
from services.rollout.sglang_sync import receive_version
from services.trainer.weight_sync import WeightBroadcaster
from tests import sglang_contract as sg
from tests.fakes.sglang_server import serve_fake, spawn_fake

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

PROMPT = [1, 14, 15, 16, 17]
LONG = [3 + i % 20 for i in range(240)]  # the tiny models' context is 256: 16 tokens left
EOS = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("sglang-contract-calls")
    out = {}
    for version in (0, 1):
        build_tiny_model(root / f"v{version}", seed=version)
        out[version] = str(root / f"v{version}")
    return out


def check_calls(calls: list[dict], tokenizer, vocab: int, context: int) -> list[str]:
    """Check every recorded call against sglang; returns the paths in order."""
    for call in calls:
        path, body = call["path"], call["body"]
        sg.route(path)  # a route sglang serves
        if path == "/generate":
            sg.check_generate(body, tokenizer, vocab, context)
        elif call["method"] == "POST":
            sg.check_control(path, body)
    return [call["path"] for call in calls]


def req(rid: str, max_new: int = 12, stops=(EOS,), **params) -> GenRequest:
    return GenRequest(rid, list(PROMPT), SamplingParams(max_new_tokens=max_new, **params), stops)


async def test_generate_abort_and_disk_update_calls_pass_sglang_checks(models):
    answers: list[dict] = []

    def keep(answer: dict) -> dict:
        answers.append(answer)
        return answer

    async with serve_fake(
        models[0], sglang_version=sg.version(), weight_version="0", token_delay_s=0.02
    ) as fake:
        fake.mangle = keep
        engine = SGLangEngine(SGLangConfig(url=fake.url))
        await engine.start()
        try:
            await engine.load(models[0], 0)
            info = await engine.model_info()
            running = [
                asyncio.create_task(engine.generate(r))
                for r in (
                    req("g:1", 80, (), temperature=0.8, top_k=0, ignore_eos=True),
                    req("g:10", 40, stop=["a", "b"], ignore_eos=True),
                    GenRequest("g:2", LONG, SamplingParams(max_new_tokens=100), [EOS]),
                )
            ]
            while fake.stats["tokens"] < 6:
                await asyncio.sleep(0.01)
            cancelled = asyncio.create_task(engine.generate(req("g:3", 40, ignore_eos=True)))
            await asyncio.sleep(0.1)
            cancelled.cancel()
            await engine.update_weights(models[1], 1)  # pause (abort) -> disk -> continue
            outs = await asyncio.gather(*running)
            await asyncio.sleep(0.2)  # the cancelled request's abort
        finally:
            await engine.stop()
        tokenizer, config = fake.tokenizer, fake.model.config
        paths = check_calls(fake.calls, tokenizer, config.vocab_size, fake.context)
    assert {"/generate", "/abort_request", "/pause_generation", "/continue_generation"} <= set(
        paths
    )
    assert "/update_weights_from_disk" in paths and "/v1/models" in paths
    assert (outs[0].versions[-1], outs[0].interruptions) == (1, 1)
    assert len(outs[2].output_ids) <= 16 and fake.context == 256
    api = sg.api_types()
    for answer in answers:
        api.GenerateResponse.from_json_value(answer)
    api.GetModelInfoResponse.from_json_value(info)


async def test_collective_update_calls_run_inside_the_weight_update_session(models):
    """Over gloo against the fake in its own process (the trainer's half in a thread)."""
    port = free_port()
    with spawn_fake(models[0], "--weight-version", "0", "--sglang-version", sg.version()) as url:
        engine = SGLangEngine(
            SGLangConfig(
                url=url,
                weight_sync="nccl",
                nccl_master=f"127.0.0.1:{port}",
                nccl_backend="gloo",
            )
        )
        await engine.start()
        try:
            await engine.load(models[0], 0)
            sender = WeightBroadcaster(  # tiny buckets: many update calls
                "127.0.0.1", port, world_size=2, backend="gloo", bucket_bytes=8
            )
            state = load_state_dict_files(models[1])
            thread = threading.Thread(target=sender.send_state, args=(1, state))
            thread.start()
            await engine.update_weights(models[1], 1)
            await asyncio.to_thread(thread.join, 60)
            sender.close()
            await engine.generate(req("after", 4))
            async with aiohttp.ClientSession() as s, s.get(f"{url}/fake_calls") as r:
                calls = await r.json()
        finally:
            await engine.stop()
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(models[0])
    paths = check_calls(
        calls,
        AutoTokenizer.from_pretrained(models[0]),
        config.vocab_size,
        config.max_position_embeddings,
    )
    updates = [i for i, p in enumerate(paths) if p == "/update_weights_from_distributed"]
    assert len(updates) > 1
    assert paths[updates[0] - 1] == "/begin_weight_update"
    assert paths[updates[-1] + 1] == "/end_weight_update"
    assert paths.count("/begin_weight_update") == paths.count("/end_weight_update") == 1
    assert paths.index("/pause_generation") < updates[0] < paths.index("/continue_generation")


async def test_session_left_open_is_reopened_and_a_failed_bucket_still_closes_it(models):
    """A session an earlier update left open: closed and begun again; a bucket the server
    refuses (no update group here): its error is raised and the session closed anyway."""
    async with serve_fake(models[0], sglang_version=sg.version()) as fake:
        async with aiohttp.ClientSession() as http:

            async def request(method: str, path: str, body: dict | None) -> dict:
                async with http.request(method, fake.url + path, json=body) as r:
                    text = await r.text()
                    if r.status != 200:
                        raise SGLangError(f"{path}: {error_message(r.status, text)}", r.status)
                    return await r.json()

            await request("POST", "/begin_weight_update", {})  # left open
            fake.calls.clear()
            with pytest.raises(SGLangError, match="no weights update group 'grp'"):
                plan = buckets.plan([("a.weight", "float32", (2,))], 64, packed=True)
                await receive_version(request, plan, group="grp", weight_version=1, session=True)
        assert not fake.update_session
        assert [c["path"] for c in fake.calls] == [
            "/begin_weight_update",  # 400: already open
            "/end_weight_update",
            "/begin_weight_update",
            "/update_weights_from_distributed",  # 400: no group
            "/end_weight_update",
        ]
