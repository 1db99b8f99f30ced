"""The SGLang fake is as strict as SGLang 0.5.23 where the engine relies on it: each test here
fails if the fake goes back to being kinder than the server (tests/fakes/sglang_server.py)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from asyncrl.tiny import build_tiny_model
from tests.fakes.sglang_server import serve_fake

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

PROMPT = [1, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("sglang-strict")
    out = {}
    for version in (0, 1):
        build_tiny_model(root / f"v{version}", seed=version)
        out[version] = str(root / f"v{version}")
    return out


async def post(url: str, path: str, body=None) -> tuple[int, object]:
    async with aiohttp.ClientSession() as s:
        kwargs = {} if body is None else {"json": body}
        async with s.post(url + path, **kwargs) as r:
            text = await r.text()
            try:
                return r.status, await r.json(content_type=None)
            except ValueError:
                return r.status, text


async def get(url: str, path: str) -> tuple[int, object]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path) as r:
            return r.status, (await r.json(content_type=None) if r.status == 200 else None)


def gen(max_new: int = 4, rid: str | None = None, prompt=PROMPT, **sp) -> dict:
    body = {
        "input_ids": list(prompt),
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new, **sp},
    }
    return body | ({"rid": rid} if rid else {})


async def test_generate_refuses_what_sglang_refuses(models):
    async with serve_fake(models[0]) as fake:
        context = fake.context
        status, answer = await post(fake.url, "/generate", gen(seed=3))
        assert status == 400 and answer["error"].startswith("unknown field `seed`, expected one")
        status, answer = await post(fake.url, "/generate", gen(temperature=0.8, top_k=0))
        assert status == 400
        assert answer["error"]["message"] == "top_k must be -1 (disable) or at least 1, got 0."
        assert (await post(fake.url, "/generate", gen(temperature=0.0, top_k=0)))[0] == 200
        status, answer = await post(fake.url, "/generate", gen(stop=["x"] * 33))
        assert status == 400
        assert answer["error"]["message"] == "at most 32 stop strings are allowed, got 33"
        assert (await post(fake.url, "/generate", gen(stop=["x"] * 32)))[0] == 200
        long = [3 + i % 20 for i in range(context - 5)]
        status, answer = await post(fake.url, "/generate", gen(max_new=6, prompt=long))
        assert status == 400 and "exceeds the model's maximum context length" in str(answer)
        assert (await post(fake.url, "/generate", gen(max_new=5, prompt=long)))[0] == 200
        status, answer = await post(fake.url, "/generate", gen(prompt=long + [3] * 5))
        assert status == 400 and "longer than the model's context length" in str(answer)
        assert await get(fake.url, "/v1/models") == (
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": models[0],
                        "object": "model",
                        "root": models[0],
                        "max_model_len": context,
                    }
                ],
            },
        )
        assert (await get(fake.url, "/get_weight_version"))[0] == 404  # gone in 0.5.23


async def test_control_bodies_required_and_pause_mode_checked(models):
    async with serve_fake(models[0]) as fake:
        assert (await post(fake.url, "/pause_generation"))[0] == 422
        status, answer = await post(fake.url, "/pause_generation", {"mode": "stop"})
        assert status == 422 and answer["detail"][0]["loc"] == ["body", "mode"]
        assert (await post(fake.url, "/continue_generation"))[0] == 422
        assert (await post(fake.url, "/abort_request"))[0] == 422
        names = {"names": ["a"], "dtypes": ["float32"]}  # no shapes
        assert (await post(fake.url, "/update_weights_from_distributed", names))[0] == 422
        assert (await post(fake.url, "/update_weights_from_disk", {}))[0] == 422
        assert (await post(fake.url, "/pause_generation", {"mode": "abort"}))[0] == 200
        assert (await post(fake.url, "/continue_generation", {}))[0] == 200


async def test_distributed_update_needs_a_session_from_0_5_21(models):
    bucket = {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "g"}
    async with serve_fake(models[0]) as fake:
        status, answer = await post(fake.url, "/update_weights_from_distributed", bucket)
        assert status == 400 and answer["message"] == (
            "update_weights_from_distributed must run between begin_weight_update() and "
            "end_weight_update()"
        )
        assert (await post(fake.url, "/end_weight_update", {}))[0] == 400
        assert (await post(fake.url, "/begin_weight_update", {}))[0] == 200
        status, answer = await post(fake.url, "/begin_weight_update", {})
        assert status == 400 and "already open" in answer["message"]
        status, answer = await post(fake.url, "/update_weights_from_distributed", bucket)
        assert status == 400 and "no weights update group 'g'" in answer["message"]
        assert (await post(fake.url, "/end_weight_update", {}))[0] == 200
    async with serve_fake(models[0], sglang_version="0.5.20") as fake:
        assert (await post(fake.url, "/begin_weight_update", {}))[0] == 404
        status, answer = await post(fake.url, "/update_weights_from_distributed", bucket)
        assert status == 400 and "no weights update group" in answer["message"]


async def test_abort_matches_by_prefix_and_duplicate_ids_are_refused(models):
    async with serve_fake(models[0], token_delay_s=0.05) as fake:
        tasks = {
            rid: asyncio.create_task(post(fake.url, "/generate", gen(40, rid, ignore_eos=True)))
            for rid in ("g:1", "g:10", "g:2")
        }
        while len(fake._started()) < 3:
            await asyncio.sleep(0.01)
        status, answer = await post(fake.url, "/generate", gen(rid="g:2"))
        assert status == 400 and answer["error"]["message"] == "Duplicate request ID detected: g:2"
        assert (await post(fake.url, "/abort_request", {"rid": "", "abort_all": False}))[0] == 200
        assert (await post(fake.url, "/abort_request", {"rid": "g:1"}))[0] == 200
        finish = {
            rid: (await task)[1]["meta_info"]["finish_reason"]["type"]
            for rid, task in tasks.items()
        }
        assert finish == {"g:1": "abort", "g:10": "abort", "g:2": "length"}


async def test_abort_pause_returns_once_running_requests_answered(models):
    async with serve_fake(models[0], token_delay_s=0.05, pause_poll_s=0.3) as fake:
        task = asyncio.create_task(post(fake.url, "/generate", gen(200, ignore_eos=True)))
        while not fake._started():
            await asyncio.sleep(0.01)
        start = time.monotonic()
        assert (await post(fake.url, "/pause_generation", {"mode": "abort"}))[0] == 200
        assert task.done() and time.monotonic() - start >= 0.3  # polled once at least
        assert (await task)[1]["meta_info"]["finish_reason"]["type"] == "abort"


async def test_answer_reports_the_version_when_the_request_finished(models):
    async with serve_fake(
        models[0], weight_version="0", token_delay_s=0.05, abort_delay_s=3.0, pause_poll_s=0.1
    ) as fake:
        task = asyncio.create_task(post(fake.url, "/generate", gen(200, ignore_eos=True)))
        while not fake._started():
            await asyncio.sleep(0.01)
        await post(fake.url, "/pause_generation", {"mode": "abort"})
        update = {"model_path": models[1], "weight_version": "1"}
        assert (await post(fake.url, "/update_weights_from_disk", update))[0] == 200
        await post(fake.url, "/continue_generation", {})
        assert not task.done()  # its answer is still in transit, the weights already swapped
        meta = (await task)[1]["meta_info"]
        assert (meta["finish_reason"]["type"], meta["weight_version"]) == ("abort", "0")


async def test_health_fails_while_paused_longer_than_the_probe_waits(models):
    async with serve_fake(models[0], health_timeout_s=0.3) as fake:
        await post(fake.url, "/pause_generation", {"mode": "abort"})
        assert (await get(fake.url, "/health_generate"))[0] == 503
        probe = asyncio.create_task(get(fake.url, "/health_generate"))
        await asyncio.sleep(0.05)
        await post(fake.url, "/continue_generation", {})
        assert (await probe)[0] == 200  # the probe got through once generation continued
