"""The SGLang HTTP protocol as the engine speaks it: request bodies, answer parsing, version
differences. Pure functions; `tests/unit/test_sglang_contract.py` checks each body against the
installed `sglang` package's own request schema and validators.

What the server refuses, and what this module does about it (SGLang 0.5.23):
- `top_k` must be -1 or >= 1 (`SamplingParams.verify`). The spec allows 0, which means "no
  top-k filter" to the torch engine (it filters only when top_k > 0): it is sent as -1, what
  SGLang calls "disable". Not an error.
- At most 32 `stop` strings (`MAX_STOP_COUNT`). The experiment spec refuses more (INVALID_ARGUMENT
  naming `...gconfig.stop`); a request that still carries more (a workflow's override) fails
  here with `InvalidSampling` naming `stop`, before it reaches the server.
- prompt + `max_new_tokens` beyond the model's context is a 400. With the context the server
  reports (`GET /v1/models` -> `max_model_len`), `max_new_tokens` is clamped so that
  prompt + max_new_tokens <= context (the sample then ends with "length"); a prompt that does
  not fit at all (prompt >= context) fails with `PromptTooLong`, giving both lengths.
- LoRA (`--enable-lora`): an adapter is loaded under a name (`/load_lora_adapter`), named per
  request (`lora_path`), unloaded by name; a name in use is refused ("already loaded"), so every
  load gets a new one (`adapter_name`). A request naming an adapter that was unloaded makes the
  server load it again from its path (`_resolve_lora_path`): the engine names only the adapter
  it serves, chosen after any update has finished.
- `/abort_request` matches request ids by prefix: aborting `g:1` aborts `g:10` too. Every id
  we send is `wire_rid(...)`: length-prefixed and numbered per engine, so no id we send is a
  prefix of another.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from asyncrl.spec import SamplingParams

MAX_STOP_STRINGS = 32
"""SGLang's `MAX_STOP_COUNT` (sampling/sampling_params.py)."""


class SGLangError(RuntimeError):
    """SGLang answered an error (bad update path, bad request, unexpected abort)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class SGLangBadResponse(SGLangError):
    """SGLang answered 200 with a body that breaks the API contract (not JSON, no logprobs,
    token ids that disagree): an unsupported server or configuration, not retried."""

    def __init__(self, message: str):
        super().__init__(message, status=200)


class InvalidSampling(ValueError):
    """A sampling parameter SGLang would refuse; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class PromptTooLong(ValueError):
    """The prompt (plus the tokens generated so far) fills the model's whole context."""


@dataclass(frozen=True)
class ServerApi:
    """What differs between the SGLang versions we support (0.4.10 - 0.5.23)."""

    version: tuple[int, int, int]

    @property
    def reports_weight_version(self) -> bool:
        return self.version >= (0, 5, 1)

    @property
    def pause_body(self) -> dict | None:
        return {"mode": "abort"} if self.version >= (0, 5, 5) else None

    @property
    def needs_update_session(self) -> bool:
        """`/update_weights_from_distributed` only between `/begin_weight_update` and
        `/end_weight_update` (the routes appear in 0.5.21)."""
        return self.version >= (0, 5, 21)

    @property
    def takes_flattened_buckets(self) -> bool:
        """`/update_weights_from_distributed` takes `load_format: "flattened_bucket"` (one
        broadcast per bucket; sgl-project/sglang#13824, merged after 0.5.5). An older server
        ignores the field and would wait for one broadcast per tensor."""
        return self.version >= (0, 5, 6)

    @property
    def model_info_paths(self) -> tuple[str, str]:
        """Preferred path first; the other is tried on 404."""
        if self.version >= (0, 5, 9):
            return "/model_info", "/get_model_info"
        return "/get_model_info", "/model_info"


def wire_rid(rid: str, segment: int, seq: int) -> str:
    """The request id sent for segment `segment` of request `rid`, the engine's `seq`-th id:
    `<n>:<rid>/r<segment>.<seq>` where n is the length of what follows the colon. No two
    distinct ids of this form are prefixes of one another (equal prefixes before the first
    colon mean equal lengths), so SGLang's prefix-matching abort hits exactly one request."""
    body = f"{rid}/r{segment}.{seq}"
    return f"{len(body)}:{body}"


def adapter_name(version: int, load: int) -> str:
    """The name adapter `version` is loaded under, `load` being the engine's count of adapter
    loads: a version published again (after a rewind) never meets its old name."""
    return f"asyncrl-v{version}-{load}"


def lora_load_body(name: str, path: str) -> dict:
    return {"lora_name": name, "lora_path": path}


def lora_unload_body(name: str) -> dict:
    return {"lora_name": name}


def sglang_top_k(top_k: int) -> int:
    """The spec's top_k as SGLang takes it: 0 and -1 both mean "no top-k filter" (-1)."""
    return -1 if top_k <= 0 else top_k


def check_stops(params: SamplingParams) -> None:
    """InvalidSampling naming `stop` when SGLang would refuse the stop strings."""
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidSampling(
            "stop", f"SGLang takes at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}"
        )


def max_new_within(prompt_len: int, max_new: int, context: int | None) -> int:
    """`max_new` clamped so that prompt + max_new <= context, the server's admission rule
    (tokenizer_manager: prompt >= context is refused, prompt + max_new > context too).
    PromptTooLong when the prompt alone does not fit; no clamp when context is None."""
    if context is None:
        return max_new
    if prompt_len >= context:
        raise PromptTooLong(
            f"the input ({prompt_len} tokens) does not fit the model's context length "
            f"({context} tokens)"
        )
    return min(max_new, context - prompt_len)


def generate_body(
    req,
    rid: str,
    done: list[int],
    stop_ids: list[int],
    context: int | None = None,
    adapter: str | None = None,
) -> dict:
    """The /generate request of the segment of `req` (a GenRequest) that continues after the
    tokens `done`, `rid` being its wire id (`wire_rid`), under the LoRA adapter loaded as
    `adapter` (None: the base)."""
    p = req.params
    check_stops(p)
    input_ids = list(req.input_ids) + done
    return {
        **({"lora_path": adapter} if adapter else {}),
        "input_ids": input_ids,
        "rid": rid,
        "return_logprob": True,
        "stream": False,
        "sampling_params": {
            "max_new_tokens": max_new_within(len(input_ids), p.max_new_tokens - len(done), context),
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": sglang_top_k(p.top_k),
            "stop_token_ids": stop_ids,
            "ignore_eos": p.ignore_eos,
            "n": 1,
            **({"stop": list(p.stop)} if p.stop else {}),
        },
    }


def abort_body(rid: str) -> dict:
    return {"rid": rid, "abort_all": False}


def continue_body() -> dict:
    return {}


def session_body() -> dict:
    """The body of `/begin_weight_update` and `/end_weight_update` (defaults: all runners)."""
    return {}


def disk_update_body(model_dir: str, version: int, api: ServerApi) -> dict:
    body: dict = {"model_path": model_dir, "abort_all_requests": False}
    if api.reports_weight_version:
        body["weight_version"] = str(version)
    return body


def init_group_body(
    master: str, rank_offset: int, world_size: int, group: str, backend: str
) -> dict:
    host, port = master.rsplit(":", 1)
    return {
        "master_address": host,
        "master_port": int(port),
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group,
        "backend": backend,
    }


def parse_context_length(data: Any) -> int | None:
    """The model's context length from a `GET /v1/models` answer (`data[0].max_model_len`);
    None when the server does not report it."""
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list) or not cards or not isinstance(cards[0], dict):
        return None
    value = cards[0].get("max_model_len")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse_generate_response(data: Any) -> tuple[list[int], list[float], str, dict]:
    """(token ids, logprobs, finish type, meta_info) of one non-streamed /generate answer.
    Token ids come from `output_token_logprobs` ([logprob, token_id, text|None] triples),
    present whether or not the server returns `output_ids`. Raises SGLangBadResponse when
    the answer breaks that contract."""
    if isinstance(data, list):
        if len(data) != 1:
            raise SGLangBadResponse(f"expected one answer, got a list of {len(data)}")
        data = data[0]
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        raise SGLangBadResponse(f"no meta_info in the answer: {str(data)[:200]}")
    output_ids = data.get("output_ids")
    triples = meta.get("output_token_logprobs")
    if triples is None:
        if output_ids or meta.get("completion_tokens"):
            raise SGLangBadResponse(
                "tokens without output_token_logprobs (the server ignored return_logprob)"
            )
        triples = []
    ids, lps = _logprob_triples(triples)
    if output_ids is not None and list(output_ids) != ids:
        raise SGLangBadResponse(
            f"output_ids ({len(output_ids)} tokens) disagree with the token ids of "
            f"output_token_logprobs ({len(ids)})"
        )
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    return ids, lps, kind or "length", meta


def _logprob_triples(triples: Any) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) of SGLang's [[logprob, token_id, text|None], ...]."""
    expected = "output_token_logprobs is not a list of [logprob, token_id, text]"
    if not isinstance(triples, list):
        raise SGLangBadResponse(f"{expected}: a {type(triples).__name__}")
    try:
        return [int(t[1]) for t in triples], [float(t[0]) for t in triples]
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise SGLangBadResponse(f"{expected} ({exc})") from None


def parse_json(text: str) -> Any:
    """The JSON body of a 200 answer; SGLangBadResponse when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        raise SGLangBadResponse(f"answer is not JSON: {text[:200]!r}") from None


def error_message(status: int, body: str) -> str:
    """The human part of an SGLang error answer: {"message"}, {"error": {"message"}},
    {"error": "..."} (the /generate schema check), {"error_message"} (the LoRA routes'
    LoRAUpdateOutput) or FastAPI's {"detail": [...]} (a 422)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip() or f"HTTP {status}"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            return str(error.get("message", data))
        if isinstance(error, str):
            return error
        if "message" in data:
            return str(data["message"])
        if data.get("error_message"):
            return str(data["error_message"])
        if isinstance(data.get("detail"), list):
            return "; ".join(_detail(d) for d in data["detail"])
    return str(data)


def _detail(item: Any) -> str:
    """One FastAPI validation error: "body.mode: Input should be 'abort', ..."."""
    if not isinstance(item, dict):
        return str(item)
    where = ".".join(str(p) for p in item.get("loc", []))
    return f"{where}: {item.get('msg', item)}" if where else str(item.get("msg", item))
