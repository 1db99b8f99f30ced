"""An OpenAI-compatible chat-completions endpoint for agent code, in the rollout service.

Agent code written against the OpenAI API (the `openai` SDK, or any HTTP client) runs inside a
workflow unchanged: `ctx.openai(traj)` opens a session bound to the trajectory being built and
yields `base_url` and `api_key`. Every `POST {base_url}/chat/completions` of that session is a
`ChatSession.send` (asyncrl.workflow): the policy samples the reply through the engine
(interruptible, per-token versions), the template's markup and tool/user turns become
environment tokens, and the reply goes back in the OpenAI response format. The api key names
the session, so concurrent samples never mix.

The server binds 127.0.0.1 on a free port (or `--openai-port`) the first time a session opens.
Supported: `messages`, `temperature`, `top_p`, `max_tokens` / `max_completion_tokens`, `stop`,
`n: 1`, `stream` (server-sent events: the reply in one content chunk once it is complete, then
the finish chunk, usage if `stream_options.include_usage`, `[DONE]`). Anything the policy
cannot honour (`tools`, `n > 1`, ...) is a 400 naming the field, in OpenAI's error format; an
unknown key is a 401.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from asyncrl.logging import get_logger
from asyncrl.workflow import ChatContextError, ChatSession

log = get_logger(component="openai_api")

MODEL_NAME = "policy"
_UNSUPPORTED = ("tools", "functions", "tool_choice", "response_format")


class RequestError(ValueError):
    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(f"{param}: {message}")
        self.param, self.message, self.status = param, message, status


def sampling_overrides(body: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling fields as `SamplingParams` overrides; RequestError if a field is
    one the policy cannot honour or has the wrong type."""
    for name in _UNSUPPORTED:
        if body.get(name):
            raise RequestError(name, "not supported by the asyncrl policy endpoint")
    if body.get("n", 1) != 1:
        raise RequestError("n", "only n=1 (the system samples the group)")
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            if not isinstance(body[name], int | float) or isinstance(body[name], bool):
                raise RequestError(name, "must be a number")
            out[name] = float(body[name])
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
            raise RequestError("max_tokens", "must be a positive integer")
        out["max_new_tokens"] = limit
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestError("stop", "must be a string or a list of strings")
        out["stop"] = stop
    return out


def check_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "a non-empty list is required")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}]", "each message needs a role")
        if not isinstance(m.get("content"), str):
            raise RequestError(f"messages[{i}].content", "must be a string")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class OpenAIEndpoint:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, port
        self._sessions: dict[str, ChatSession] = {}
        self._runner: web.AppRunner | None = None
        self._lock = asyncio.Lock()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> None:
        async with self._lock:
            if self._runner is not None:
                return
            app = web.Application()
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_get("/v1/models", self._models)
            # a client that goes away (its workflow was cancelled: group aborted, rollout
            # stopping) cancels the handler, and with it the engine request
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, self.host, self.port).start()
            self.port = runner.addresses[0][1]
            self._runner = runner
            log.info("openai_endpoint_started", url=self.base_url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @contextlib.asynccontextmanager
    async def session(self, chat: ChatSession) -> AsyncIterator[dict[str, str]]:
        """Register `chat` under a fresh key for the duration of the block; yields the client
        arguments (`base_url`, `api_key`)."""
        await self.start()
        key = "asyncrl-" + secrets.token_hex(12)
        self._sessions[key] = chat
        try:
            yield {"base_url": self.base_url, "api_key": key}
        finally:
            self._sessions.pop(key, None)

    # ---------------------------------------------------------------- handlers
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "asyncrl"}],
            }
        )

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            chat = self._authorized(request)
            try:
                body = await request.json()
            except ValueError:
                raise RequestError("body", "not JSON") from None
            if not isinstance(body, dict):
                raise RequestError("body", "must be a JSON object")
            overrides = sampling_overrides(body)
            messages = check_messages(body)
            try:
                reply = await chat.send(messages, **overrides)
            except ChatContextError as e:
                raise RequestError("messages", str(e).removeprefix("messages: ")) from None
        except RequestError as e:
            return _error(e)
        prompt_tokens = len(chat.ctx.prompt_ids) + len(chat.traj.output_ids) - len(reply.output_ids)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(reply.output_ids),
            "total_tokens": prompt_tokens + len(reply.output_ids),
        }
        head = {
            "id": f"chatcmpl-{secrets.token_hex(8)}",
            "created": int(time.time()),
            "model": body.get("model") or MODEL_NAME,
        }
        finish = "length" if reply.finish_reason == "length" else "stop"
        if body.get("stream"):
            return await self._stream(request, head, reply.text, finish, usage, body)
        message = {"role": "assistant", "content": reply.text}
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        return web.json_response(
            {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
        )

    async def _stream(self, request, head, text, finish, usage, body) -> web.StreamResponse:
        """The finished reply as server-sent chat.completion.chunk events."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {**head, "object": "chat.completion.chunk"}
        deltas = [
            ({"role": "assistant", "content": text}, None),
            ({}, finish),
        ]
        for delta, reason in deltas:
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            await resp.write(_event({**chunk, "choices": [choice]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(_event({**chunk, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _authorized(self, request: web.Request) -> ChatSession:
        auth = request.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip()
        chat = self._sessions.get(key)
        if chat is None:
            raise RequestError("api_key", "unknown or finished session", status=401)
        return chat


def _event(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def _error(e: RequestError) -> web.Response:
    kind = "authentication_error" if e.status == 401 else "invalid_request_error"
    return web.json_response(
        {"error": {"message": str(e), "type": kind, "param": e.param, "code": None}},
        status=e.status,
    )
