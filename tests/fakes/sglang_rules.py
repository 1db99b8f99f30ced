"""What the SGLang server (0.5.23) admits and how it samples, for the HTTP fake
(tests/fakes/sglang_server.py). Each rule cites where SGLang has it;
tests/unit/test_sglang_contract.py checks the ones that can drift (the sampling keys, the stop
limit, the pause modes) against the installed `sglang` package."""

from __future__ import annotations

import json

import torch
from aiohttp import web

SAMPLING_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
"""The keys of sglang.api.v1.api_types.SamplingParams, the /generate schema ("unknown keys
rejected")."""
MAX_STOP_COUNT = 32
"""sglang/srt/sampling/sampling_params.py."""
PAUSE_MODES = ("abort", "retract", "in_place")
"""io_struct.PauseGenerationReqInput.mode (a Literal: anything else is a 422)."""
SAMPLING_EPS = 1e-6


class HttpError(Exception):
    """An error answer: `payload` is its JSON body (default {"error": {"message"}})."""

    def __init__(self, status: int, message: str, payload: dict | None = None):
        super().__init__(message)
        self.status = status
        self.payload = payload if payload is not None else {"error": {"message": message}}


def unprocessable(where: str, message: str) -> HttpError:
    """FastAPI's 422 for a body that does not parse into the route's request type."""
    loc = ["body", where] if where else ["body"]
    return HttpError(422, message, {"detail": [{"loc": loc, "msg": message}]})


async def json_body(request: web.Request, required: tuple[str, ...] = ()) -> dict:
    """The JSON object a route parses into its io_struct type (FastAPI `Body()`): a 422 when
    it is missing, not an object, or lacks a field the type requires."""
    text = await request.text()
    if not text.strip():
        raise unprocessable("", "Field required")
    try:
        body = json.loads(text)
    except ValueError:
        raise unprocessable("", "JSON decode error") from None
    if not isinstance(body, dict):
        raise unprocessable("", "Input should be a valid dictionary")
    for name in required:
        if name not in body:
            raise unprocessable(name, "Field required")
    return body


def check_sampling_keys(sp: object) -> None:
    """The /generate schema check (api_contract.generate_contract_error): a 400 whose
    "error" is serde's text for the first unknown sampling key."""
    if not isinstance(sp, dict):
        raise HttpError(400, "invalid type: expected struct SamplingParams", {"error": "map"})
    for key in sp:
        if key not in SAMPLING_KEYS:
            listed = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            message = f"unknown field `{key}`, expected one of {listed}"
            raise HttpError(400, message, {"error": message})


def normalized_sampling(sp: dict) -> dict:
    """`sp` as SamplingParams.__post_init__ + normalize + verify leave it (the parts the fake
    uses), or a 400 with SGLang's message: temperature ~0 means greedy (top_k 1), top_k -1
    the whole vocabulary; top_k must then be >= 1; at most 32 stop strings."""
    out = dict(sp)
    temperature = out.get("temperature")
    temperature = 1.0 if temperature is None else float(temperature)
    top_k = out.get("top_k")
    top_k = -1 if top_k is None else int(top_k)
    if 0 <= temperature < SAMPLING_EPS:
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = 1 << 30
    out["temperature"], out["top_k"] = temperature, top_k
    stops = out.get("stop") or []
    stops = [stops] if isinstance(stops, str) else list(stops)
    if len(stops) > MAX_STOP_COUNT:
        raise HttpError(400, f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stops)}")
    out["stop"] = stops
    if top_k < 1:
        raise HttpError(400, f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    top_p = float(1.0 if out.get("top_p") is None else out["top_p"])
    if not 0.0 < top_p <= 1.0:
        raise HttpError(400, f"top_p must be in (0, 1], got {top_p}.")
    return out


def check_context(prompt_len: int, max_new: int, context: int) -> None:
    """tokenizer_manager's length checks (no --allow-auto-truncate): a 400 when the prompt
    does not fit, or prompt + max_new_tokens exceeds the context."""
    if prompt_len >= context:
        raise HttpError(
            400,
            f"The input ({prompt_len} tokens) is longer than the model's context length "
            f"({context} tokens).",
        )
    if prompt_len + max_new > context:
        raise HttpError(
            400,
            "Requested token count exceeds the model's maximum context length of "
            f"{context} tokens. You requested a total of {prompt_len + max_new} tokens: "
            f"{prompt_len} tokens from the input messages and {max_new} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit.",
        )


def sample(
    logits: torch.Tensor,
    sp: dict,
    gen: torch.Generator | None = None,
    original_logprob: bool = True,
) -> tuple[int, float]:
    """(token, logprob) the way SGLang samples, `sp` normalized (`normalized_sampling`):
    greedy is top_k 1; top-k/top-p filter the sampling distribution but not the reported
    logprob (the unscaled log-softmax with original_logprob, else temperature-scaled)."""
    temperature = float(sp.get("temperature", 1.0))
    top_k = int(sp.get("top_k", 1 << 30))
    top_p = float(sp.get("top_p", 1.0) or 1.0)
    raw = torch.log_softmax(logits, dim=-1)
    if top_k == 1:
        token = int(torch.argmax(logits))
        return token, float(raw[token])
    probs = torch.softmax(logits / temperature, dim=-1)
    table = raw if original_logprob else torch.log(probs).clamp(min=torch.finfo(probs.dtype).min)
    keep = probs.clone()
    if top_k < keep.numel():
        keep[keep < torch.topk(keep, top_k).values[-1]] = 0.0
    if top_p < 1.0:
        sorted_p, order = torch.sort(keep, descending=True)
        sorted_p[(torch.cumsum(sorted_p, 0) - sorted_p) > top_p] = 0.0
        keep = torch.zeros_like(keep).scatter_(0, order, sorted_p)
    token = int(torch.multinomial(keep, 1, generator=gen))
    return token, float(table[token])
