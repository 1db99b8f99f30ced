"""An HTTP fake of the SGLang server, for tests (SGLang itself needs CUDA).

It follows SGLang's HTTP API (0.4.10 - 0.5.23; `--sglang-version`, default 0.5.23) with a real
model: a HuggingFace causal LM (the tiny test models) generates real tokens with real logprobs,
one request at a time per coroutine with a KV cache. It is as strict as the server on what the
rollout engine relies on (tests/integration/test_sglang_fake_strict.py catches each rule's return):
- `/generate` (one sample, no batch) with `input_ids`, `sampling_params`, `return_logprob`,
  `rid`; an unknown `sampling_params` key, `top_k` 0 (unless greedy), more than 32 `stop`
  strings, a prompt + `max_new_tokens` beyond the context (`GET /v1/models` ->
  `max_model_len`, the HF `max_position_embeddings`) or a request id in use are a 400 with
  SGLang's message (tests/fakes/sglang_rules.py). `meta_info` has `finish_reason {type}`,
  `output_token_logprobs [[lp, id, None], ...]` and `weight_version`, the version when the
  request finished.
- `/pause_generation` needs a body (`mode`: abort, retract or in_place; else a 422) from 0.5.5;
  in abort mode it aborts the running requests and returns once they have all answered,
  polling every `pause_poll_s` (1 s, as SGLang); in_place/retract: they wait.
  `/continue_generation` needs a body too. New `/generate` calls block while paused or while
  weights are being swapped, they are never rejected. `/health_generate` answers 503 when the
  pause outlasts `health_timeout_s` (SGLang's probe request waits behind it for 20 s).
- `/abort_request` aborts every request whose id starts with `rid`, as SGLang's scheduler.
- `/update_weights_from_disk` waits for running requests (SGLang's writer lock), swaps the
  weights and the reported `weight_version`; a bad path or a model of another shape is a 400
  with a message. `/init_weights_update_group` + `/update_weights_from_distributed` receive
  tensors by collective broadcast (gloo on CPU, nccl on GPU), the trainer being rank 0: one
  broadcast per tensor, or with `load_format: "flattened_bucket"` one broadcast of the listed
  tensors back to back (`flattened_layout`: a misaligned offset or an empty list is a 400
  "Failed to receive weights: ...", before any broadcast, as SGLang's `FlattenedTensorBucket`;
  any other load_format, or any before 0.5.6, is the per-tensor path, as SGLang); from
  0.5.21 only inside a `/begin_weight_update` ... `/end_weight_update` session (a 400 outside
  one; a second begin while one is open is a 400). A control body that is missing, or lacks a
  field its io_struct type requires, is a 422.
- LoRA (`--enable-lora`, `/load_lora_adapter`, `/unload_lora_adapter`, `lora_path` per
  request), as tests/fakes/sglang_lora.py says.
- Version differences: weight_version from 0.5.1, a pause `mode` body from 0.5.5,
  `/model_info` from 0.5.9 (`/get_model_info` before), the update session from 0.5.21.
- Logprobs as SGLang computes them: temperature-scaled by default, the unscaled log-softmax
  with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (0.5.x); never renormalised by top-k/top-p.
Test-only extras: `--token-delay-s` (sleep after each token so tests can interrupt mid-way),
`--abort-delay-s` (an aborted request's answer arrives that much later: in transit, after its
version was read), `GET /fake_stats`, `GET /fake_weights` (a digest of every served tensor,
`tensor_digest`), `GET /fake_calls` (every call the fake got: method, path, JSON body) and, in
process, `FakeSGLang.mangle` (rewrites each `/generate` answer, to test how a client takes a
malformed one).

    python -m tests.fakes.sglang_server --model-path DIR --port P [--weight-version 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from aiohttp import web

from asyncrl.net import free_port
from tests.fakes.sglang_lora import LoraFlags, LoraRoutes
from tests.fakes.sglang_rules import (
    PAUSE_MODES,
    HttpError,
    check_context,
    check_sampling_keys,
    json_body,
    normalized_sampling,
    sample,
    unprocessable,
)
from tests.fakes.sglang_weights import WeightRoutes, load_model, tensor_digest  # noqa: F401

log = logging.getLogger("fake_sglang")


def parse_version(text: str) -> tuple[int, int, int]:
    nums = [int(n) for n in re.findall(r"\d+", text)[:3]]
    return tuple(nums + [0] * (3 - len(nums)))  # type: ignore[return-value]


@dataclass
class _Request:
    rid: str
    started: bool = False  # past the pause gate: holds SGLang's reader lock until it answers
    aborted: bool = False
    adapter: str | None = None  # the LoRA adapter it runs under (None: the base)


class FakeSGLang(WeightRoutes, LoraRoutes):
    def __init__(
        self,
        model_path: str | Path,
        *,
        sglang_version: str = "0.5.23",
        weight_version: str = "default",
        token_delay_s: float = 0.0,
        abort_delay_s: float = 0.0,
        random_seed: int = 1,
        return_original_logprob: bool | None = None,
        pause_poll_s: float = 1.0,
        health_timeout_s: float = 20.0,
        lora: LoraFlags | None = None,
    ):
        self.sglang_version = sglang_version
        self.api = parse_version(sglang_version)
        self.model_path = str(model_path)
        self.weight_version = str(weight_version)
        self.token_delay_s = token_delay_s
        self.abort_delay_s = abort_delay_s
        self.random_seed = random_seed
        self.pause_poll_s = pause_poll_s
        self.health_timeout_s = health_timeout_s
        if return_original_logprob is None:
            return_original_logprob = any(
                os.environ.get(k, "").lower() in ("1", "true")
                for k in ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")
            )
        self.original_logprob = return_original_logprob and self.api >= (0, 5, 0)
        self.model = None
        self.tokenizer = None
        self.paused = False
        self.pause_mode = "abort"
        self.updating = False
        self.update_session = False  # between /begin_weight_update and /end_weight_update
        self.requests: list[_Request] = []
        self.groups: dict[str, object] = {}
        self.stats = {"requests": 0, "tokens": 0, "aborted": 0, "updates": 0, "broadcasts": 0}
        self.calls: list[dict] = []
        """Every call but health and fake_*: {"method", "path", "body"} (body: JSON or None)."""
        self.mangle: Callable[[dict], dict | str] | None = None
        """Test hook: rewrites each /generate answer (a str is sent as a plain-text body)."""
        self.url = ""
        self._gate = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._loading: asyncio.Task | None = None
        self._lora_init(lora)

    # ---------------------------------------------------------------- lifecycle
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/model_info" if self.api >= (0, 5, 9) else "/get_model_info", self.model_info)
        r.add_get("/v1/models", self.models)
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        if self.api >= (0, 5, 21):
            r.add_post("/begin_weight_update", self.begin_weight_update)
            r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        r.add_get("/fake_stats", self.fake_stats)
        r.add_get("/fake_weights", self.fake_weights)
        r.add_get("/fake_calls", self.fake_calls)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        """Record the call; answer an HttpError with its status and JSON body."""
        if not request.path.startswith(("/health", "/fake_")):
            text = await request.text()
            try:
                body = json.loads(text) if text.strip() else None
            except ValueError:
                body = text
            self.calls.append({"method": request.method, "path": request.path, "body": body})
        try:
            return await handler(request)
        except HttpError as e:
            return web.json_response(e.payload, status=e.status)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve HTTP at once (503 on health until the model is loaded); return the URL."""
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        self._loading = asyncio.create_task(self._load(self.model_path))
        return self.url

    async def ready(self) -> None:
        await self._loading

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
            self._runner = None

    async def _load(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.model = await asyncio.to_thread(load_model, path)
        self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)

    async def _changed(self) -> None:
        async with self._gate:
            self._gate.notify_all()

    async def _wait_for(self, predicate) -> None:
        async with self._gate:
            await self._gate.wait_for(predicate)

    def _started(self) -> list[_Request]:
        return [r for r in self.requests if r.started]

    @property
    def context(self) -> int:
        """The model's context length (SGLang's model_config.context_len)."""
        return self.model.config.max_position_embeddings

    # ---------------------------------------------------------------- info
    async def health(self, request: web.Request) -> web.Response:
        """SGLang's probe is a one-token request: while paused it waits behind the pause and
        the check fails after health_timeout_s (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s)."""
        if self.model is None:
            return web.Response(status=503)
        if self.paused:
            try:
                await asyncio.wait_for(
                    self._wait_for(lambda: not self.paused), self.health_timeout_s
                )
            except TimeoutError:
                return web.Response(status=503)
        return web.Response(status=200)

    def _info(self) -> dict:
        info = {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
        }
        if self.api >= (0, 5, 1):
            info["weight_version"] = self.weight_version
        return info

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self._info(), "version": self.sglang_version, "tp_size": 1})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._info())

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_path, "object": "model", "root": self.model_path}
        if self.model is not None:
            card["max_model_len"] = self.context
        return web.json_response({"object": "list", "data": [card]})

    async def fake_stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                **self.stats,
                "running": len(self._started()),
                "paused": self.paused,
                "weight_version": self.weight_version,
            }
        )

    async def fake_calls(self, request: web.Request) -> web.Response:
        return web.json_response(self.calls)

    # ---------------------------------------------------------------- generation
    async def generate(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        ids = body.get("input_ids")
        if ids is None:
            raise HttpError(400, "this fake needs input_ids (text input is not supported)")
        sp = body.get("sampling_params") or {}
        check_sampling_keys(sp)
        if (ids and isinstance(ids[0], list)) or int(sp.get("n") or 1) != 1:
            raise HttpError(400, "this fake serves one sample per request (no batch, n=1)")
        if self.model is None:
            raise HttpError(503, "the server is still starting")
        adapter = await self.resolve_adapter(body.get("lora_path"))
        answer = await self._one(
            ids, sp, body.get("rid"), bool(body.get("return_logprob")), adapter
        )
        if self.mangle is not None:
            answer = self.mangle(answer)
            if isinstance(answer, str):
                return web.Response(text=answer)
        return web.json_response(answer)

    async def _one(
        self, ids: list[int], sp: dict, rid: str | None, logprob: bool, adapter: str | None
    ) -> dict:
        if not ids:
            raise HttpError(400, "input_ids is empty")
        if rid is not None and any(r.rid == rid for r in self.requests):
            raise HttpError(400, f"Duplicate request ID detected: {rid}")
        req = _Request(rid or uuid.uuid4().hex, adapter=adapter)
        self.requests.append(req)
        self.stats["requests"] += 1
        self.adapter_users[adapter] += 1
        try:
            await self._wait_for(lambda: req.aborted or not (self.paused or self.updating))
            max_new = 128 if sp.get("max_new_tokens") is None else int(sp["max_new_tokens"])
            check_context(len(ids), max_new, self.context)
            sp = normalized_sampling({**sp, "max_new_tokens": max_new})
            req.started = True
            answer = await self._decode(req, list(ids), sp, logprob)
        finally:
            req.started = False
            self.requests.remove(req)
            self.adapter_users[adapter] -= 1
            await self._changed()
        if req.aborted:  # the answer travels back after the scheduler dropped the request
            await asyncio.sleep(self.abort_delay_s)
        return answer

    async def _decode(self, req: _Request, ids: list[int], sp: dict, logprob: bool) -> dict:
        max_new = sp["max_new_tokens"]
        stop_ids = set(sp.get("stop_token_ids") or [])
        if not sp.get("ignore_eos", False):
            eos = self.model.config.eos_token_id  # no swap while a request runs
            stop_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        stops = sp["stop"]
        seed = int(sp.get("sampling_seed") or self.random_seed)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(req.rid.encode()))
        out: list[int] = []
        lps: list[float] = []
        feed, cache = ids, None
        finish = {"type": "length", "length": max_new}
        while len(out) < max_new:
            if self.paused and self.pause_mode != "abort" and not req.aborted:
                await self._wait_for(lambda: not self.paused or req.aborted)
            if req.aborted:
                self.stats["aborted"] += 1
                finish = {"type": "abort", "message": "Abort before or during generation."}
                break
            with torch.inference_mode():
                inputs = {"input_ids": torch.tensor([feed]), "past_key_values": cache}
                res = self.forward(req.adapter, **inputs, use_cache=True)
            cache = res.past_key_values
            token, lp = sample(res.logits[0, -1].float(), sp, gen, self.original_logprob)
            out.append(token)
            lps.append(lp)
            self.stats["tokens"] += 1
            if token in stop_ids:
                finish = {"type": "stop", "matched": token}
                break
            text = self._text(out) if stops else ""
            hit = next((s for s in stops if s and text.endswith(s)), None)
            if hit is not None:
                finish = {"type": "stop", "matched": hit}
                break
            feed = [token]
            if len(out) < max_new:
                await asyncio.sleep(self.token_delay_s)  # a token boundary: pause/abort land here
        meta = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
        }
        if logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out, strict=True)]
        if self.api >= (0, 5, 1):  # the version when the request finished, as SGLang
            meta["weight_version"] = self.weight_version
        return {"text": self._text(out), "output_ids": out, "meta_info": meta}

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    # ---------------------------------------------------------------- control
    def _abort(self, rid: str, abort_all: bool, started_only: bool = False) -> None:
        """SGLang's scheduler: every request whose id starts with `rid` (an empty rid without
        abort_all aborts nothing)."""
        if not abort_all and not rid:
            return
        for req in self._started() if started_only else self.requests:
            if abort_all or req.rid.startswith(rid):
                req.aborted = True

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        self._abort(str(body.get("rid") or ""), bool(body.get("abort_all")))
        await self._changed()
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = "abort"
        if self.api >= (0, 5, 5):
            mode = (await json_body(request)).get("mode", "abort")
            if mode not in PAUSE_MODES:
                raise unprocessable("mode", f"Input should be one of {PAUSE_MODES}, got {mode!r}")
        self.paused, self.pause_mode = True, mode
        while mode == "abort":  # abort the running requests until none holds the lock
            self._abort("", abort_all=True, started_only=True)
            await self._changed()
            if not self._started():
                break
            await asyncio.sleep(self.pause_poll_s)
        await self._changed()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        if self.api >= (0, 5, 5):
            await json_body(request)
        self.paused = False
        await self._changed()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        busy = bool(self._started())
        return web.Response(status=400 if busy else 200, text="Cache flushed.\n")


# -------------------------------------------------------------------- for tests
def fake_launch_cmd(*extra: str) -> list[str]:
    """`launch_cmd` for SGLangEngine/SGLangProcess that starts this fake instead of SGLang."""
    return [sys.executable, "-m", "tests.fakes.sglang_server", *extra]


@contextlib.asynccontextmanager
async def serve_fake(model_path: str | Path, **opts):
    """Run a FakeSGLang in this process on a free port; yields it (`.url`) once loaded."""
    fake = FakeSGLang(model_path, **opts)
    await fake.start()
    try:
        await fake.ready()
        yield fake
    finally:
        await fake.stop()


@contextlib.contextmanager
def spawn_fake(
    model_path: str | Path,
    *args: str,
    port: int = 0,
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
):
    """Run the fake as a separate process (what a service under test can reach); yields its
    URL once healthy. `args`: more CLI flags, e.g. "--token-delay-s", "0.01"."""
    import subprocess
    import time
    import urllib.request

    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        fake_launch_cmd("--model-path", str(model_path), "--port", str(port), *args),
        env={**os.environ, **(env or {})},
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, f"fake SGLang exited with {proc.returncode}"
            try:
                with urllib.request.urlopen(f"{url}/health_generate", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "fake SGLang did not become healthy"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def sglang_fake_model(tmp_path_factory) -> str:
    """The model the fake starts with; override this fixture to serve another one."""
    from asyncrl.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("sglang-fake") / "model"
    build_tiny_model(path)
    return str(path)


@pytest.fixture
async def sglang_fake(sglang_fake_model):
    """A FakeSGLang on a free port (temperature-scaled logprobs, like the managed child)."""
    async with serve_fake(
        sglang_fake_model, weight_version="0", return_original_logprob=False
    ) as fake:
        yield fake


@pytest.fixture
async def sglang_fake_url(sglang_fake) -> str:
    return sglang_fake.url


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--random-seed", type=int, default=1)
    p.add_argument("--sglang-version", default="0.5.23")
    p.add_argument("--token-delay-s", type=float, default=0.0)
    p.add_argument("--abort-delay-s", type=float, default=0.0)
    p.add_argument("--pause-poll-s", type=float, default=1.0)
    p.add_argument("--health-timeout-s", type=float, default=20.0)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--lora-target-modules", nargs="*", default=[])
    args, ignored = p.parse_known_args(argv)  # --tp-size, --mem-fraction-static, ...
    logging.basicConfig(level=logging.INFO, format="fake_sglang %(message)s")
    log.info("starting on %s:%s (ignoring %s)", args.host, args.port, " ".join(ignored))
    torch.set_num_threads(1)

    async def run() -> None:
        fake = FakeSGLang(
            args.model_path,
            sglang_version=args.sglang_version,
            weight_version=args.weight_version,
            token_delay_s=args.token_delay_s,
            abort_delay_s=args.abort_delay_s,
            random_seed=args.random_seed,
            pause_poll_s=args.pause_poll_s,
            health_timeout_s=args.health_timeout_s,
            lora=LoraFlags(args.max_lora_rank, tuple(args.lora_target_modules))
            if args.enable_lora
            else None,
        )
        await fake.start(args.host, args.port)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await fake.stop()

    asyncio.run(run())


if __name__ == "__main__":
    main()
