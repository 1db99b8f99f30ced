"""An HTTP fake of the SGLang server, for tests (SGLang itself needs CUDA).

It follows SGLang's HTTP API (0.4.10 - 0.5.x) with a real model: a HuggingFace causal LM
(the tiny test models) generates real tokens with real logprobs, one request at a time per
coroutine with a KV cache. What it reproduces, because the rollout engine relies on it:
- `/generate` (one sample, no batch) with `input_ids`, `sampling_params` (max_new_tokens,
  temperature, top_p, top_k, stop_token_ids, stop, ignore_eos), `return_logprob`, `rid`;
  `meta_info` with `finish_reason {type}`, `output_token_logprobs [[lp, id, None], ...]`,
  `weight_version`.
- `/pause_generation` (abort mode: running requests return `finish_reason abort` with their
  partial output; in_place/retract: they wait) and `/continue_generation`; new `/generate`
  calls block while paused or while weights are being swapped, they are never rejected.
- `/update_weights_from_disk` waits for running requests (SGLang's writer lock), swaps the
  weights and the reported `weight_version`; a bad path or a model of another shape is a 400
  with a message. `/init_weights_update_group` + `/update_weights_from_distributed` receive
  tensors by collective broadcast (gloo on CPU, nccl on GPU), the trainer being rank 0.
- Version differences (`--sglang-version`): weight_version only from 0.5.1, a pause `mode`
  body from 0.5.5, `/model_info` from 0.5.9 (`/get_model_info` before).
- Logprobs as SGLang computes them: temperature-scaled by default, the unscaled log-softmax
  with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (0.5.x); never renormalised by top-k/top-p.
Test-only extras: `--token-delay-s` (sleep after each token so tests can interrupt mid-way),
`--abort-delay-s` (an aborted request's answer arrives that much later, possibly after a
weight swap: `weight_version` is read when the answer is built, as in SGLang),
`GET /fake_stats`, `GET /fake_weights` (a digest of every served tensor, `tensor_digest`) and,
in process, `FakeSGLang.mangle` (rewrites each `/generate` answer, to
test how a client takes a malformed one).

    python -m tests.fakes.sglang_server --model-path DIR --port P [--weight-version 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
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
from services.trainer.weight_sync import init_custom_group  # SGLang's recipe, as the trainer's

log = logging.getLogger("fake_sglang")


def parse_version(text: str) -> tuple[int, int, int]:
    nums = [int(n) for n in re.findall(r"\d+", text)[:3]]
    return tuple(nums + [0] * (3 - len(nums)))  # type: ignore[return-value]


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes: equal digests mean equal tensors."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class _Request:
    rid: str
    started: bool = False  # past the pause gate, producing tokens
    aborted: bool = False


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class FakeSGLang:
    def __init__(
        self,
        model_path: str | Path,
        *,
        sglang_version: str = "0.5.9",
        weight_version: str = "default",
        token_delay_s: float = 0.0,
        abort_delay_s: float = 0.0,
        random_seed: int = 1,
        return_original_logprob: bool | None = None,
    ):
        self.sglang_version = sglang_version
        self.api = parse_version(sglang_version)
        self.model_path = str(model_path)
        self.weight_version = str(weight_version)
        self.token_delay_s = token_delay_s
        self.abort_delay_s = abort_delay_s
        self.random_seed = random_seed
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
        self.requests: list[_Request] = []
        self.groups: dict[str, object] = {}
        self.stats = {"requests": 0, "tokens": 0, "aborted": 0, "updates": 0}
        self.mangle: Callable[[dict], dict | str] | None = None
        """Test hook: rewrites each /generate answer (a str is sent as a plain-text body)."""
        self.url = ""
        self._gate = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._loading: asyncio.Task | None = None

    # ---------------------------------------------------------------- lifecycle
    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/model_info" if self.api >= (0, 5, 9) else "/get_model_info", self.model_info)
        if self.api >= (0, 5, 1):
            r.add_get("/get_weight_version", self.get_weight_version)
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_get("/fake_stats", self.fake_stats)
        r.add_get("/fake_weights", self.fake_weights)
        return app

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

    # ---------------------------------------------------------------- info
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.model is not None else 503)

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

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def fake_stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                **self.stats,
                "running": len(self._started()),
                "paused": self.paused,
                "weight_version": self.weight_version,
            }
        )

    async def fake_weights(self, request: web.Request) -> web.Response:
        state = self.model.state_dict()
        return web.json_response({name: tensor_digest(t) for name, t in state.items()})

    # ---------------------------------------------------------------- generation
    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            ids = body.get("input_ids")
            if ids is None:
                raise HttpError(400, "this fake needs input_ids (text input is not supported)")
            sp = body.get("sampling_params") or {}
            logprob = bool(body.get("return_logprob", False))
            rid = body.get("rid")
            if (ids and isinstance(ids[0], list)) or int(sp.get("n", 1)) != 1:
                raise HttpError(400, "this fake serves one sample per request (no batch, n=1)")
            answer = await self._one(ids, sp, rid, logprob)
        except HttpError as e:
            return web.json_response({"error": {"message": str(e)}}, status=e.status)
        if self.mangle is not None:
            answer = self.mangle(answer)
            if isinstance(answer, str):
                return web.Response(text=answer)
        return web.json_response(answer)

    async def _one(self, ids: list[int], sp: dict, rid: str | None, logprob: bool) -> dict:
        if not ids:
            raise HttpError(400, "input_ids is empty")
        if self.model is None:
            raise HttpError(503, "the server is still starting")
        context = self.model.config.max_position_embeddings
        if len(ids) >= context:
            raise HttpError(
                400,
                f"The input ({len(ids)} tokens) is longer than the model's "
                f"context length ({context} tokens).",
            )
        req = _Request(rid or uuid.uuid4().hex)
        self.requests.append(req)
        self.stats["requests"] += 1
        try:
            await self._wait_for(lambda: req.aborted or not (self.paused or self.updating))
            req.started = True
            return await self._decode(req, list(ids), sp, logprob, context)
        finally:
            self.requests.remove(req)
            await self._changed()

    async def _decode(
        self, req: _Request, ids: list[int], sp: dict, logprob: bool, context: int
    ) -> dict:
        model = self.model  # no swap while a request runs
        max_new = min(int(sp.get("max_new_tokens", 128)), context - len(ids))
        stop_ids = set(sp.get("stop_token_ids") or [])
        if not sp.get("ignore_eos", False):
            eos = model.config.eos_token_id
            stop_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        stops = sp.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        seed = int(sp.get("sampling_seed", self.random_seed))
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(req.rid.encode()))
        out: list[int] = []
        lps: list[float] = []
        feed, cache = ids, None
        while True:
            if self.paused and self.pause_mode != "abort" and not req.aborted:
                await self._wait_for(lambda: not self.paused or req.aborted)
            if req.aborted:
                self.stats["aborted"] += 1
                finish = {"type": "abort", "message": "Abort before or during generation."}
                # The scheduler has dropped it (a weight swap may go ahead); the answer
                # travels back through the detokenizer, possibly after the swap.
                req.started = False
                await self._changed()
                await asyncio.sleep(self.abort_delay_s)
                break
            with torch.inference_mode():
                res = model(input_ids=torch.tensor([feed]), past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            token, lp = self.sample(res.logits[0, -1].float(), sp, gen)
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
            if len(out) >= max_new:
                finish = {"type": "length", "length": max_new}
                break
            feed = [token]
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
        if self.api >= (0, 5, 1):  # read when the answer is built, as SGLang does
            meta["weight_version"] = self.weight_version
        return {"text": self._text(out), "output_ids": out, "meta_info": meta}

    def sample(self, logits: torch.Tensor, sp: dict, gen: torch.Generator | None = None):
        """(token, logprob) the way SGLang samples: temperature 0 is greedy; top-k/top-p
        filter the sampling distribution but not the reported logprob."""
        temperature = float(sp.get("temperature", 1.0))
        top_k = int(sp.get("top_k", -1))
        top_p = float(sp.get("top_p", 1.0))
        raw = torch.log_softmax(logits, dim=-1)
        if temperature < 1e-5 or top_k == 1:
            token = int(torch.argmax(logits))
            return token, float(raw[token])
        probs = torch.softmax(logits / temperature, dim=-1)
        table = (
            raw
            if self.original_logprob
            else torch.log(probs).clamp(min=torch.finfo(probs.dtype).min)
        )
        keep = probs.clone()
        if 0 < top_k < keep.numel():
            keep[keep < torch.topk(keep, top_k).values[-1]] = 0.0
        if top_p < 1.0:
            sorted_p, order = torch.sort(keep, descending=True)
            sorted_p[(torch.cumsum(sorted_p, 0) - sorted_p) > top_p] = 0.0
            keep = torch.zeros_like(keep).scatter_(0, order, sorted_p)
        token = int(torch.multinomial(keep, 1, generator=gen))
        return token, float(table[token])

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    # ---------------------------------------------------------------- control
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        for req in self.requests:
            if body.get("abort_all") or req.rid == body.get("rid"):
                req.aborted = True
        await self._changed()
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = "abort"
        if self.api >= (0, 5, 5) and request.can_read_body:
            mode = (await request.json() or {}).get("mode", "abort")
        self.paused, self.pause_mode = True, mode
        if mode == "abort":
            for req in self._started():
                req.aborted = True
        await self._changed()
        return web.json_response({"status": "ok", "message": "Generation paused successfully."})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.paused = False
        await self._changed()
        return web.json_response({"status": "ok", "message": "Generation continued successfully."})

    async def flush_cache(self, request: web.Request) -> web.Response:
        busy = bool(self._started())
        return web.Response(status=400 if busy else 200, text="Cache flushed.\n")

    def _set_version(self, body: dict) -> str:
        if self.api >= (0, 5, 1) and body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
            return f" Weight version updated to {self.weight_version}."
        return ""

    async def _exclusive(self, body: dict, swap) -> None:
        """Block new requests, wait for the running ones (SGLang's writer lock), run swap."""
        if body.get("abort_all_requests"):
            for req in self.requests:
                req.aborted = True
        self.updating = True
        try:
            await self._wait_for(lambda: not self._started())
            await swap()
        finally:
            self.updating = False
            await self._changed()

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        path = body.get("model_path") or ""

        def fail(message: str) -> web.Response:
            return web.json_response(
                {"success": False, "message": message, "num_paused_requests": 0}, status=400
            )

        if not (Path(path) / "config.json").is_file():
            return fail(
                f"Failed to update weights: {path!r} is not a model directory (no config.json)"
            )
        try:
            new = await asyncio.to_thread(load_model, path)
        except Exception as e:  # noqa: BLE001 - reported like SGLang does
            return fail(f"Failed to update weights: {type(e).__name__}: {e}")
        old_shapes = {k: v.shape for k, v in self.model.state_dict().items()}
        new_shapes = {k: v.shape for k, v in new.state_dict().items()}
        if old_shapes != new_shapes:
            return fail(
                f"Failed to update weights: the model at {path!r} has other parameters "
                "or shapes than the served one"
            )

        async def swap():
            self.model, self.model_path = new, path

        await self._exclusive(body, swap)
        self.stats["updates"] += 1
        message = "Succeeded to update model weights." + self._set_version(body)
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        b = await request.json()
        try:
            self.groups[b["group_name"]] = await asyncio.to_thread(
                init_custom_group,
                b.get("backend", "nccl"),
                b["master_address"],
                int(b["master_port"]),
                int(b["rank_offset"]),
                int(b["world_size"]),
                b["group_name"],
            )
        except Exception as e:  # noqa: BLE001
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize group."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        b = await request.json()
        group = self.groups.get(b.get("group_name"))
        if group is None:
            return web.json_response(
                {
                    "success": False,
                    "message": f"no weights update group {b.get('group_name')!r}: init it first",
                },
                status=400,
            )

        def receive():
            import torch.distributed as dist

            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
            state = self.model.state_dict(keep_vars=True)
            with torch.no_grad():
                for name, dtype, shape in zip(b["names"], b["dtypes"], b["shapes"], strict=True):
                    t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                    dist.broadcast(t, src=0, group=group)
                    state[name].copy_(t.to("cpu", state[name].dtype))

        async def swap():
            await asyncio.to_thread(receive)

        await self._exclusive(b, swap)
        return web.json_response(
            {
                "success": True,
                "message": "Succeeded to update parameter online." + self._set_version(b),
            }
        )


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
        env={**os.environ, "SGLANG_RETURN_ORIGINAL_LOGPROB": "1", **(env or {})},
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
    """A FakeSGLang on a free port (unscaled logprobs, like the managed child)."""
    async with serve_fake(
        sglang_fake_model, weight_version="0", return_original_logprob=True
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
    p.add_argument("--sglang-version", default="0.5.9")
    p.add_argument("--token-delay-s", type=float, default=0.0)
    p.add_argument("--abort-delay-s", type=float, default=0.0)
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
