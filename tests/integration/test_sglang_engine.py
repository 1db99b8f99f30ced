"""SGLangEngine against the HTTP fake of SGLang (tests/fakes/sglang_server.py), which serves
real tiny HF models: generation, per-token logprobs, interruption by weight updates, the
version differences, the managed child (restart after a kill), and the collective update path
(gloo here; nccl on a machine with two GPUs)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import aiohttp
import pytest
import torch

from asyncrl.natsutil import wait_until
from asyncrl.net import free_port
from asyncrl.spec import SamplingParams
from asyncrl.tiny import build_tiny_model
from asyncrl.weights import load_state_dict_files
from services.rollout.engine import GenRequest
from services.rollout.sglang_config import SGLangConfig
from services.rollout.sglang_engine import SGLangBadResponse, SGLangEngine, SGLangError
from services.rollout.sglang_process import (
    SGLANG_MISSING,
    LaunchConfig,
    SGLangNotInstalled,
    sglang_launchable,
)
from services.trainer.weight_sync import WeightBroadcaster
from tests.fakes.sglang_server import fake_launch_cmd, serve_fake, spawn_fake

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

pytest_plugins = ["tests.fakes.sglang_server"]  # the sglang_fake / sglang_fake_url fixtures

PROMPT = [1, 14, 15, 16, 17]  # <bos> + four characters
EOS = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, str]:
    """Version -> model dir: two tiny Qwen2 models with the same shapes, other weights."""
    root = tmp_path_factory.mktemp("sglang-models")
    out = {}
    for version in (0, 1):
        build_tiny_model(root / f"v{version}", seed=version)
        out[version] = str(root / f"v{version}")
    return out


_hf_cache: dict[str, torch.nn.Module] = {}


def hf_logprobs(
    model_dir: str, prompt: list[int], output: list[int], temperature: float = 1.0
) -> list[float]:
    """Per-token logprobs of `output` after `prompt` at `temperature` from one HF forward."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _hf_cache:
        _hf_cache[model_dir] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = _hf_cache[model_dir](input_ids=ids).logits[0].float() / temperature
    lps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return lps[torch.arange(len(output)), torch.tensor(output)].tolist()


def check_logprobs(models: dict[int, str], prompt: list[int], out, temperature=1.0) -> None:
    """Every token's logprob is the HF logprob at `temperature` under the version recorded for
    it."""
    for version in set(out.versions):
        expected = hf_logprobs(models[version], prompt, out.output_ids, temperature)
        for i, v in enumerate(out.versions):
            if v == version:
                assert out.logprobs[i] == pytest.approx(expected[i], abs=1e-4), (i, v)


def req(rid: str, max_new: int = 24, **params) -> GenRequest:
    return GenRequest(rid, list(PROMPT), SamplingParams(max_new_tokens=max_new, **params), [EOS])


async def wait_tokens(stats, at_least: int, timeout: float = 20.0) -> None:
    """Wait until the fake has produced `at_least` tokens (stats: a dict or a coroutine fn)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        now = stats() if callable(stats) else stats
        now = await now if asyncio.iscoroutine(now) else now
        if now["tokens"] >= at_least:
            return
        assert loop.time() < deadline, f"fake produced only {now['tokens']} tokens"
        await asyncio.sleep(0.01)


@pytest.fixture
async def attached(models, request):
    """(engine, fake): an engine attached to an in-process fake serving v0."""
    opts = getattr(request, "param", {})
    async with serve_fake(
        models[0], weight_version="0", return_original_logprob=False, **opts
    ) as fake:
        engine = SGLangEngine(SGLangConfig(url=fake.url))
        await engine.start()
        await engine.load(models[0], 0)
        try:
            yield engine, fake
        finally:
            await engine.stop()


async def test_generate_against_fake_logprobs_equal_hf_forward(attached, models):
    engine, fake = attached
    outs = await asyncio.gather(
        *(engine.generate(req(f"g{i}", temperature=0.8, top_k=20)) for i in range(3))
    )
    for out in outs:
        assert out.finish_reason in ("stop", "length")
        assert len(out.output_ids) == len(out.logprobs) == len(out.versions) > 0
        assert set(out.versions) == {0}
        assert out.interruptions == 0
        if out.finish_reason == "stop":
            assert out.output_ids[-1] == EOS
        else:
            assert len(out.output_ids) == 24
        check_logprobs(models, PROMPT, out, temperature=0.8)  # SGLang's default: scaled
    assert fake.stats["requests"] == 3


async def test_sglang_fake_url_fixture_serves_generate(sglang_fake_url):
    engine = SGLangEngine(SGLangConfig(url=sglang_fake_url))
    await engine.start()
    try:
        out = await engine.generate(req("fixture", max_new=4))
        assert len(out.output_ids) <= 4 and out.versions == [0] * len(out.output_ids)
    finally:
        await engine.stop()


@pytest.mark.parametrize("version", ["0.5.9", "0.5.0", "0.4.10"])
async def test_update_mid_generation_keeps_both_versions_in_order_no_sample_lost(models, version):
    # < 0.5.1 reports no weight_version: the engine tracks versions itself.
    async with serve_fake(
        models[0],
        sglang_version=version,
        weight_version="0",
        token_delay_s=0.01,
        abort_delay_s=0.1,  # aborted answers arrive late, as through SGLang's detokenizer
        return_original_logprob=True,
    ) as fake:
        engine = SGLangEngine(SGLangConfig(url=fake.url))
        await engine.start()
        try:
            await engine.load(models[0], 0)
            n = 6
            tasks = [
                asyncio.create_task(engine.generate(req(f"s{i}", max_new=24))) for i in range(n)
            ]
            await wait_tokens(fake.stats, 4 * n)
            interrupted = await engine.update_weights(models[1], 1)
            outs = await asyncio.gather(*tasks)
        finally:
            await engine.stop()
    assert interrupted >= 1 and fake.stats["aborted"] >= 1
    assert engine.version == 1
    assert len(outs) == n
    mixed = 0
    for out in outs:
        assert out.versions == sorted(out.versions)  # 0..0 then 1..1
        assert len(out.output_ids) == 24 or out.finish_reason == "stop"
        check_logprobs(models, PROMPT, out)  # each token scored by the weights that made it
        if set(out.versions) == {0, 1}:
            mixed += 1
            assert out.interruptions >= 1
    assert mixed >= 1


async def test_generate_while_paused_blocks_until_continue(attached):
    engine, fake = attached
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{fake.url}/pause_generation", json={"mode": "abort"}) as r:
            assert r.status == 200
        task = asyncio.create_task(engine.generate(req("blocked", max_new=6)))
        await wait_until(lambda: fake.stats["requests"] == 1)  # it reached the server
        assert not task.done()  # blocked by the server, not rejected
        assert fake.stats["tokens"] == 0
        async with http.post(f"{fake.url}/continue_generation", json={}) as r:
            assert r.status == 200
    out = await asyncio.wait_for(task, 10)
    assert 0 < len(out.output_ids) <= 6 and out.interruptions == 0


@pytest.mark.parametrize("attached", [{"token_delay_s": 0.01}], indirect=True)
async def test_abort_request_returns_partial_output(attached):
    _, fake = attached
    body = {
        "input_ids": PROMPT,
        "rid": "partial",
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
    }
    async with aiohttp.ClientSession() as http:
        gen = asyncio.create_task(http.post(f"{fake.url}/generate", json=body))
        await wait_tokens(fake.stats, 5)
        async with http.post(f"{fake.url}/abort_request", json={"rid": "partial"}) as r:
            assert r.status == 200
        resp = await gen
        data = await resp.json()
    meta = data["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 5 <= len(data["output_ids"]) < 200
    assert [t[1] for t in meta["output_token_logprobs"]] == data["output_ids"]


async def test_update_bad_path_raises_clear_error_old_weights_keep_serving(attached, tmp_path):
    engine, fake = attached
    missing = tmp_path / "no-such-version"
    with pytest.raises(SGLangError, match="no-such-version"):
        await engine.update_weights(str(missing), 1)
    other = tmp_path / "other-shape"
    build_tiny_model(other, hidden_size=32)
    with pytest.raises(SGLangError, match="shapes"):
        await engine.update_weights(str(other), 1)
    assert engine.version == 0 and not fake.paused and fake.weight_version == "0"
    out = await engine.generate(req("after", max_new=5))
    assert set(out.versions) == {0}


def _without_logprobs(answer: dict) -> dict:
    del answer["meta_info"]["output_token_logprobs"]
    return answer


def _one_logprob_short(answer: dict) -> dict:
    answer["meta_info"]["output_token_logprobs"].pop()
    return answer


def _null_logprob(answer: dict) -> dict:
    answer["meta_info"]["output_token_logprobs"][0][0] = None
    return answer


def _too_many_tokens(answer: dict) -> dict:
    triples = answer["meta_info"]["output_token_logprobs"]
    triples += [list(triples[0])] * 8  # asked for at most 6
    answer["output_ids"] = [t[1] for t in triples]
    return answer


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (_without_logprobs, "without output_token_logprobs"),
        (_one_logprob_short, "output_ids .* disagree"),
        (_null_logprob, r"not a list of \[logprob, token_id, text\]"),
        (_too_many_tokens, "max_new_tokens was 6"),
        (lambda answer: "Internal Server Error", "not JSON"),
        (lambda answer: {"text": answer["text"]}, "no meta_info"),
    ],
)
async def test_generate_malformed_answer_raises_bad_response_naming_the_fault(
    attached, mangle, message
):
    engine, fake = attached
    fake.mangle = mangle
    with pytest.raises(SGLangBadResponse, match=message) as exc:
        await engine.generate(req("bad", max_new=6))
    assert str(exc.value).startswith("/generate 8:bad/r0.0: ")  # the id sent (wire_rid)
    fake.mangle = None  # the engine is not wedged by a bad answer
    out = await engine.generate(req("good", max_new=6))
    assert 0 < len(out.output_ids) == len(out.logprobs) <= 6


async def test_control_call_answering_200_with_success_false_raises_sglang_error(tmp_path):
    """An update that reports failure in a 200 body must not pass for a success."""
    from aiohttp import web

    async def ok(request):
        return web.json_response({"version": "0.5.9", "status": "ok"})

    async def failed_update(request):
        return web.json_response({"success": False, "message": "weights not loaded: oom"})

    app = web.Application()
    app.router.add_get("/health_generate", ok)
    app.router.add_get("/get_server_info", ok)
    app.router.add_post("/pause_generation", ok)
    app.router.add_post("/continue_generation", ok)
    app.router.add_post("/update_weights_from_disk", failed_update)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine = SGLangEngine(SGLangConfig(url=f"http://127.0.0.1:{runner.addresses[0][1]}"))
    try:
        await engine.start()
        with pytest.raises(SGLangError, match="oom") as exc:
            await engine.update_weights(str(tmp_path), 1)
    finally:
        await engine.stop()
        await runner.cleanup()
    assert exc.value.status == 200 and engine.version == 0


@pytest.mark.parametrize("version", ["0.5.9", "0.5.4", "0.4.10"])
async def test_model_info_follows_server_version(models, version):
    async with serve_fake(models[0], sglang_version=version, weight_version="0") as fake:
        engine = SGLangEngine(SGLangConfig(url=fake.url))
        await engine.start()
        try:
            await engine.load(models[1], 1)
            info = await engine.model_info()
        finally:
            await engine.stop()
    assert info["model_path"] == models[1]
    assert info.get("weight_version") == ("1" if version != "0.4.10" else None)


async def test_managed_child_killed_restarts_with_current_weights(models, tmp_path):
    launch = LaunchConfig(
        launch_cmd=fake_launch_cmd("--token-delay-s", "0.02"), log_path=str(tmp_path / "child.log")
    )
    engine = SGLangEngine(SGLangConfig(launch=launch, sglang_version="0.5.9"))
    await engine.start()
    try:
        await engine.load(models[0], 0)
        await engine.update_weights(models[1], 1)
        first_pid = engine.process.pid

        async def stats():
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{engine.process.url}/fake_stats") as r:
                    return await r.json()

        tasks = [asyncio.create_task(engine.generate(req(f"k{i}", max_new=20))) for i in range(3)]
        await wait_tokens(stats, 6)
        os.kill(first_pid, signal.SIGKILL)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        info = await engine.model_info()
        restarts, pid = engine.process.restarts, engine.process.pid
    finally:
        await engine.stop()
    assert restarts == 1 and pid != first_pid
    assert info["model_path"] == models[1] and info["weight_version"] == "1"
    for out in outs:
        assert len(out.output_ids) == 20 or out.finish_reason == "stop"
        assert set(out.versions) == {1}
        check_logprobs(models, PROMPT, out)  # the restarted server really serves v1


@pytest.mark.skipif(sglang_launchable(), reason="sglang can launch here")
def test_launch_without_sglang_raises_clear_error():
    with pytest.raises(SGLangNotInstalled) as exc:
        SGLangEngine(SGLangConfig(launch=LaunchConfig()))
    assert str(exc.value) == SGLANG_MISSING
    assert "--sglang-url" in SGLANG_MISSING and "rollout.engine: torch" in SGLANG_MISSING


async def _collective_update(models, backend: str, child_env: dict):
    """Attach to a fake in its own process; the trainer's broadcaster (in a thread here) sends
    v1's tensors. The trainer service itself: tests/integration/test_trainer_weight_sync.py."""
    port = free_port()
    with spawn_fake(models[0], "--weight-version", "0", env=child_env) as url:
        engine = SGLangEngine(
            SGLangConfig(
                url=url,
                weight_sync="nccl",
                nccl_master=f"127.0.0.1:{port}",
                nccl_backend=backend,
            )
        )
        await engine.start()
        try:
            await engine.load(models[0], 0)
            sender = WeightBroadcaster(  # tiny buckets: many update calls
                "127.0.0.1", port, world_size=2, backend=backend, bucket_bytes=8
            )
            state = load_state_dict_files(models[1])
            errors: list[BaseException] = []

            def trainer():
                try:
                    sender.send_state(1, state)
                except BaseException as e:  # noqa: BLE001 - re-raised in the test
                    errors.append(e)

            thread = threading.Thread(target=trainer)
            thread.start()
            await engine.update_weights(models[1], 1)
            await asyncio.to_thread(thread.join, 60)
            assert not errors, errors
            sender.close()
            out = await engine.generate(req("after-broadcast", max_new=8))
            info = await engine.model_info()
        finally:
            await engine.stop()
    assert engine.version == 1 and info["weight_version"] == "1"
    assert set(out.versions) == {1}
    check_logprobs(models, PROMPT, out)


async def test_collective_update_over_gloo_serves_trainer_weights(models):
    await _collective_update(models, "gloo", {})


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per NCCL rank)")
async def test_collective_update_over_nccl_serves_trainer_weights(models):
    await _collective_update(models, "nccl", {"CUDA_VISIBLE_DEVICES": "1"})
