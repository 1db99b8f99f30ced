"""The embedded torch engine against real tiny HF models: batching, behaviour logprobs,
determinism, interruption by a weight update, cancellation."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.natsutil import wait_until
from asyncrl.spec import SamplingParams
from asyncrl.tiny import build_tiny_model
from services.rollout.engine import GenRequest
from services.rollout.torch_engine import TorchEngine, sample_tokens
from tests.integration.engine_gate import hold_generation

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
PROMPTS = [[10, 11, 12], [20], [30, 31, 32, 33, 34, 35, 36], [40, 41]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Qwen2 models with different weights: v0 and the 'trained' v1; plus a Llama,
    and a Llama with room for long contexts."""
    root = tmp_path_factory.mktemp("models")
    build_tiny_model(root / "v0", seed=0)
    build_tiny_model(root / "v1", seed=1)
    build_tiny_model(root / "llama", family="llama", seed=0)
    build_tiny_model(root / "long", family="llama", seed=4, max_position_embeddings=1024)
    return root


def _hf(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Independent HF forward over prompt + output: logprob of each output token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return lp.gather(-1, torch.tensor(output)[:, None])[:, 0]


async def _engine(path, **opts) -> TorchEngine:
    engine = TorchEngine(**opts)
    await engine.start()
    await engine.load(str(path), 0)
    return engine


async def _generate_all(engine, prompts, params, prefix="r"):
    return await asyncio.gather(
        *[engine.generate(GenRequest(f"{prefix}{i}", p, params)) for i, p in enumerate(prompts)]
    )


async def test_generate_concurrent_requests_batched_outputs_aligned(models):
    engine = await _engine(models / "v0", seed=1)
    try:
        outs = await _generate_all(engine, PROMPTS, SAMPLED)
    finally:
        await engine.stop()
    for out in outs:
        assert len(out.output_ids) == len(out.logprobs) == len(out.versions) == 12
        assert out.versions == [0] * 12 and out.finish_reason == "length"
        assert all(lp <= 0.0 for lp in out.logprobs)
    # one batch loop: 12 steps served all 4 requests (48 tokens), not 48 steps
    assert engine.steps == 12 and engine.tokens_generated == 48
    stats = engine.stats()
    assert stats["steps"] == 12 and stats["stream_steps"] == 48
    # each step attends every stream to its own context: prompt + outputs so far
    assert stats["context_tokens"] == sum(len(p) + t for p in PROMPTS for t in range(12))
    assert stats["prefill_tokens"] == sum(len(p) - 1 for p in PROMPTS)
    assert 0 < stats["prefill_seconds"] < stats["step_seconds"]


@pytest.mark.parametrize("kv_cache", [True, False])
async def test_generate_logprobs_match_independent_hf_forward(models, kv_cache):
    engine = await _engine(models / "v0", seed=2, kv_cache=kv_cache)
    try:
        outs = await _generate_all(engine, PROMPTS, SAMPLED)
    finally:
        await engine.stop()
    ref = _hf(models / "v0")
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = _reference_logprobs(ref, prompt, out.output_ids)
        assert (want - torch.tensor(out.logprobs)).abs().max().item() < 1e-4


async def test_behaviour_logprobs_at_temperature_equal_the_trainers_recompute(models):
    """At temperature 0.7 the engine's behaviour logprobs are the torch trainer's logprobs of
    the same tokens (the policy trained is the one sampled): mismatch ~1e-5 on CPU."""
    from asyncrl.spec import ExperimentSpec
    from asyncrl.types import Sample, TrajectoryGroup
    from services.trainer.backends.torch_backend import TorchBackend

    params = SamplingParams(temperature=0.7, max_new_tokens=12)
    engine = await _engine(models / "v0", seed=3)
    try:
        outs = await _generate_all(engine, PROMPTS, params)
    finally:
        await engine.stop()
    spec = ExperimentSpec(
        model={"path": str(models / "v0")},
        dataset={"path": "unused.jsonl"},
        trainer={"backend": "torch"},
        rollout={"gconfig": {"temperature": 0.7, "max_new_tokens": 12}},
    )
    trainer = TorchBackend(spec, device="cpu")
    trainer.load(str(models / "v0"))
    groups = [
        TrajectoryGroup(
            "e",
            f"g{i}",
            f"p{i}",
            "",
            "",
            p,
            [Sample(o.output_ids, o.logprobs, [0] * len(o.output_ids))],
        )
        for i, (p, o) in enumerate(zip(PROMPTS, outs, strict=True))
    ]
    recomputed = trainer.logprobs(groups)
    ref = _hf(models / "v0")
    for prompt, out, (lp,) in zip(PROMPTS, outs, recomputed, strict=True):
        assert max(abs(a - b) for a, b in zip(lp, out.logprobs, strict=True)) < 1e-4
        unscaled = _reference_logprobs(ref, prompt, out.output_ids)
        assert (unscaled - torch.tensor(out.logprobs)).abs().max().item() > 1e-3


async def test_generate_greedy_is_deterministic_and_matches_hf_argmax(models):
    runs = []
    for kv_cache in (True, False):
        engine = await _engine(models / "v0", seed=kv_cache, kv_cache=kv_cache)
        try:
            runs.append([o.output_ids for o in await _generate_all(engine, PROMPTS, GREEDY)])
        finally:
            await engine.stop()
    assert runs[0] == runs[1]
    ref = _hf(models / "v0")
    for prompt, ids in zip(PROMPTS, runs[0], strict=True):
        with torch.no_grad():
            want = ref.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12
            )[0, len(prompt) :].tolist()
        assert ids == want


async def test_generate_same_seed_and_rid_samples_identically_whatever_the_batch(models):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, max_new_tokens=12)
    a = await _engine(models / "v0", seed=7)
    b = await _engine(models / "v0", seed=7)
    try:
        alone = await a.generate(GenRequest("g:0", PROMPTS[0], params))
        batched = await asyncio.gather(
            b.generate(GenRequest("g:0", PROMPTS[0], params)),
            *[b.generate(GenRequest(f"x{i}", p, params)) for i, p in enumerate(PROMPTS)],
        )
        other = await a.generate(GenRequest("g:1", PROMPTS[0], params))
    finally:
        await a.stop()
        await b.stop()
    assert batched[0].output_ids == alone.output_ids
    assert other.output_ids != alone.output_ids  # a different request id samples differently


async def test_generate_stop_token_ends_sample_with_stop_reason(models):
    engine = await _engine(models / "v0")
    try:
        first = await engine.generate(GenRequest("s", PROMPTS[0], GREEDY))
        stop_id = first.output_ids[3]
        out = await engine.generate(GenRequest("s", PROMPTS[0], GREEDY, [stop_id]))
    finally:
        await engine.stop()
    cut = first.output_ids.index(stop_id) + 1
    assert out.output_ids == first.output_ids[:cut] and out.finish_reason == "stop"


async def test_generate_stop_string_ends_sample_at_the_token_that_completes_it(models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models / "v0"))

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    engine = await _engine(models / "v0")
    try:
        first = await engine.generate(GenRequest("s", PROMPTS[0], GREEDY))
        text = decode(first.output_ids)
        stop = decode(first.output_ids[4:6]).strip() or decode(first.output_ids[4:6])
        params = GREEDY.model_copy(update={"stop": [stop]})
        out = await engine.generate(GenRequest("s", PROMPTS[0], params, decode=decode))
        with pytest.raises(ValueError, match="params.stop"):
            await engine.generate(GenRequest("s", PROMPTS[0], params))
    finally:
        await engine.stop()
    cut = next(n for n in range(1, 13) if stop in decode(first.output_ids[:n]))
    assert stop in text and cut < len(first.output_ids)
    assert out.output_ids == first.output_ids[:cut] and out.finish_reason == "stop"


async def test_update_weights_mid_generation_versions_switch_in_order(models):
    engine = await _engine(models / "v0", seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=150)
    prompts = PROMPTS[:2]
    try:
        held = hold_generation(engine, lambda: engine.tokens_generated >= 2 * 5)
        task = asyncio.gather(
            *[engine.generate(GenRequest(f"u{i}", p, params)) for i, p in enumerate(prompts)]
        )
        await wait_until(held.is_set, timeout=30, interval=0.001)
        interrupted = await engine.update_weights(str(models / "v1"), 1)
        outs = await task
    finally:
        await engine.stop()
    assert interrupted == 2 and engine.version == 1
    old, new = _hf(models / "v0"), _hf(models / "v1")
    for prompt, out in zip(prompts, outs, strict=True):
        k = out.versions.count(0)
        assert 5 <= k < 150 and len(out.output_ids) == 150  # nothing lost
        assert out.versions == [0] * k + [1] * (150 - k)
        assert out.interruptions == 1
        got = torch.tensor(out.logprobs)
        before = _reference_logprobs(old, prompt, out.output_ids)[:k]
        after = _reference_logprobs(new, prompt, out.output_ids)[k:]
        assert (before - got[:k]).abs().max().item() < 1e-4
        assert (after - got[k:]).abs().max().item() < 1e-4
        # and the new weights really are different
        assert (_reference_logprobs(old, prompt, out.output_ids)[k:] - got[k:]).abs().max() > 1e-2


async def test_update_weights_keeping_the_kv_cache_recomputes_nothing(models):
    """keep_kv_on_update: an update interrupts the requests at a token boundary, nothing is
    re-prefilled, the versions switch in order, nothing is lost, and the tokens after the
    switch are sampled by the new weights on top of the old weights' cache: their logprobs are
    neither the old model's nor the new one's alone."""
    engine = await _engine(models / "v0", seed=3, keep_kv_on_update=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=150)
    prompts = PROMPTS[:2]
    try:
        held = hold_generation(engine, lambda: engine.tokens_generated >= 2 * 5)
        task = asyncio.gather(
            *[engine.generate(GenRequest(f"k{i}", p, params)) for i, p in enumerate(prompts)]
        )
        await wait_until(held.is_set, timeout=30, interval=0.001)
        prefilled = engine.counters.prefill_tokens
        interrupted = await engine.update_weights(str(models / "v1"), 1)
        outs = await task
    finally:
        await engine.stop()
    assert interrupted == 2 and engine.version == 1
    assert engine.counters.prefill_tokens == prefilled  # no prefix recomputed
    old, new = _hf(models / "v0"), _hf(models / "v1")
    for prompt, out in zip(prompts, outs, strict=True):
        k = out.versions.count(0)
        assert 5 <= k < 150 and len(out.output_ids) == 150
        assert out.versions == [0] * k + [1] * (150 - k)
        got = torch.tensor(out.logprobs)
        before = _reference_logprobs(old, prompt, out.output_ids)[:k]
        assert (before - got[:k]).abs().max().item() < 1e-4
        after = got[k:]
        assert (_reference_logprobs(new, prompt, out.output_ids)[k:] - after).abs().max() > 1e-3
        assert (_reference_logprobs(old, prompt, out.output_ids)[k:] - after).abs().max() > 1e-3


async def test_generate_short_requests_beside_a_very_long_one_decode_as_alone(models):
    """Greedy: a long request (700-token prompt) in the batch, short ones joining and leaving
    around it (rows freed and compacted), each sample is what it would be alone."""
    long_prompt = [4 + (7 * i) % 90 for i in range(700)]
    shorts = [([10 + i, 20 + i, 30 + i][: 1 + i % 3], 8 + 5 * i) for i in range(12)]

    def request(i: int) -> GenRequest:
        if i < 0:
            return GenRequest(
                "long", long_prompt, GREEDY.model_copy(update={"max_new_tokens": 120})
            )
        prompt, n = shorts[i]
        return GenRequest(f"s{i}", prompt, GREEDY.model_copy(update={"max_new_tokens": n}))

    engine = await _engine(models / "long")
    try:
        alone = [await engine.generate(request(i)) for i in range(-1, len(shorts))]
        before = engine.tokens_generated
        held = hold_generation(engine, lambda: engine.tokens_generated >= before + 3)
        long = asyncio.create_task(engine.generate(request(-1)))
        await wait_until(held.is_set, timeout=30, interval=0.001)
        first = await asyncio.gather(*[engine.generate(request(i)) for i in range(6)])
        rest = await asyncio.gather(*[engine.generate(request(i)) for i in range(6, 12)])
        together = [await long, *first, *rest]
    finally:
        await engine.stop()
    for got, want in zip(together, alone, strict=True):
        assert got.output_ids == want.output_ids
        diff = torch.tensor(got.logprobs) - torch.tensor(want.logprobs)
        assert diff.abs().max().item() < 1e-5


async def test_update_weights_reprefills_requests_of_mixed_lengths(models):
    """Interrupted requests of very different lengths are re-prefilled in several forwards
    (grouped by length), and continue exactly as the new weights would generate them."""
    prompts = [
        [5],
        [6, 7, 8, 9, 10],
        [11 + i % 50 for i in range(60)],
        [9 + i % 70 for i in range(170)],
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=60)
    engine = await _engine(models / "v0", seed=5)
    try:
        held = hold_generation(engine, lambda: engine.tokens_generated >= 4 * 10)
        task = asyncio.gather(
            *[engine.generate(GenRequest(f"m{i}", p, params)) for i, p in enumerate(prompts)]
        )
        await wait_until(held.is_set, timeout=30, interval=0.001)
        forwards = engine.counters.prefill_forwards
        assert await engine.update_weights(str(models / "v1"), 1) == 4
        outs = await task
    finally:
        await engine.stop()
    assert engine.counters.prefill_forwards - forwards >= 3  # not one batch padded to 230
    old, new = _hf(models / "v0"), _hf(models / "v1")
    for prompt, out in zip(prompts, outs, strict=True):
        k = out.versions.count(0)
        assert 10 <= k < 60 and out.versions == [0] * k + [1] * (60 - k)
        got = torch.tensor(out.logprobs)
        assert (_reference_logprobs(old, prompt, out.output_ids)[:k] - got[:k]).abs().max() < 1e-4
        assert (_reference_logprobs(new, prompt, out.output_ids)[k:] - got[k:]).abs().max() < 1e-4


async def test_update_weights_of_another_architecture_raises_and_keeps_version(models):
    engine = await _engine(models / "v0")
    try:
        with pytest.raises(ValueError, match="weights do not match the model"):
            await engine.update_weights(str(models / "llama"), 1)
        assert engine.version == 0
    finally:
        await engine.stop()


async def test_cancel_generate_removes_request_from_batch(models):
    engine = await _engine(models / "v0")
    long = SamplingParams(temperature=1.0, max_new_tokens=200)
    try:
        held = hold_generation(engine, lambda: engine.tokens_generated >= 3)
        doomed = asyncio.create_task(engine.generate(GenRequest("c0", PROMPTS[0], long)))
        await wait_until(held.is_set, timeout=30, interval=0.001)
        assert engine.running == 1
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert engine.running == 0
        steps, tokens = engine.steps, engine.tokens_generated
        out = await engine.generate(GenRequest("c1", PROMPTS[1], GREEDY))
        assert len(out.output_ids) == 12
        # every step since then fed one request: the cancelled one is out of the batch
        assert engine.tokens_generated - tokens == engine.steps - steps
    finally:
        await engine.stop()


async def test_generate_many_samples_as_one_generate_per_request(models):
    """A group's requests in one call: the same samples as n concurrent `generate` calls."""
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    reqs = [GenRequest(f"g:{i}", PROMPTS[0], params) for i in range(4)]
    a = await _engine(models / "v0", seed=3)
    b = await _engine(models / "v0", seed=3)
    try:
        together = await a.generate_many(reqs)
        one_by_one = await asyncio.gather(*[b.generate(r) for r in reqs])
    finally:
        await a.stop()
        await b.stop()
    assert [o.output_ids for o in together] == [o.output_ids for o in one_by_one]
    assert len({tuple(o.output_ids) for o in together}) > 1  # each request its own sample
    for x, y in zip(together, one_by_one, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


async def test_generate_many_cancelled_aborts_every_request(models):
    engine = await _engine(models / "v0")
    long = SamplingParams(temperature=1.0, max_new_tokens=200)
    try:
        held = hold_generation(engine, lambda: engine.tokens_generated >= 6)
        call = asyncio.create_task(
            engine.generate_many([GenRequest(f"c:{i}", PROMPTS[i], long) for i in range(3)])
        )
        await wait_until(held.is_set, timeout=30, interval=0.001)
        assert engine.running == 3
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert engine.running == 0
    finally:
        await engine.stop()


async def test_generate_many_bad_request_queues_none(models):
    engine = await _engine(models / "v0")
    try:
        with pytest.raises(ValueError, match="empty prompt"):
            await engine.generate_many(
                [GenRequest("b:0", PROMPTS[0], GREEDY), GenRequest("b:1", [], GREEDY)]
            )
        assert engine.running == 0 and engine.tokens_generated == 0
    finally:
        await engine.stop()


def test_sample_token_logprob_is_the_temperature_scaled_log_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.3, top_k=2, top_p=0.5, max_new_tokens=1)
    [token], [logprob] = sample_tokens(logits, [(params, gen)])
    assert token == 0  # top_p=0.5 keeps only the most likely token
    # SGLang's default (and what the trainer recomputes): log_softmax(logits / T), before top-k/p
    assert logprob == pytest.approx(float(torch.log_softmax(logits[0] / 0.3, -1)[0]))


def test_sampled_frequencies_follow_the_softmax_and_skip_impossible_tokens():
    """4,000 draws of one row from probabilities (0.1, 0.2, 0, 0.7): each frequency within
    4 standard deviations of its probability (sqrt(p(1-p)/n) <= 0.0079), token 2 never."""
    probs = torch.tensor([0.1, 0.2, 0.0, 0.7])
    logits = torch.log(probs)[None]
    gen, p = torch.Generator().manual_seed(3), SamplingParams(temperature=1.0)
    tokens = [sample_tokens(logits, [(p, gen)])[0][0] for _ in range(4000)]
    freq = torch.bincount(torch.tensor(tokens), minlength=4) / 4000
    assert freq[2] == 0
    assert torch.allclose(freq, probs, atol=4 * 0.0079), freq


def test_a_rows_tokens_depend_on_its_own_generator_not_its_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    hot, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)

    def draws(rows, params, seeds, n=20):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return [
            sample_tokens(logits[rows], list(zip(params, gens, strict=True)))[0] for _ in range(n)
        ]

    alone = [t[0] for t in draws([1], [hot], [7])]
    beside = draws([0, 1, 2], [hot, hot, greedy], [5, 7, 9])
    assert [t[1] for t in beside] == alone
    assert {t[2] for t in beside} == {int(logits[2].argmax())}  # greedy: the argmax, always
    assert len(set(alone)) > 1  # it does sample


def test_non_finite_logits_fail_the_step_instead_of_sampling_garbage():
    logits = torch.tensor([[0.0, float("nan"), 1.0]])
    with pytest.raises(ValueError, match="inf, nan"):
        sample_tokens(logits, [(SamplingParams(), torch.Generator().manual_seed(0))])
