"""HTTP calls to one SGLang server: JSON control calls checked against the API contract (a
failure must not pass for a 200), and best-effort aborts of requests whose caller went away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp

from services.rollout.sglang_protocol import (
    SGLangBadResponse,
    SGLangError,
    abort_body,
    error_message,
)

CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=60)


class SGLangClient:
    """The engine's HTTP session with its server; `url` says where the server is now (a
    managed child gets a new port when it restarts)."""

    def __init__(self, url: Callable[[], str]):
        self._url = url
        self.session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task] = set()

    def open(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=CONTROL_TIMEOUT
        )

    async def close(self) -> None:
        if self.session:
            await self.session.close()
            self.session = None

    async def request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        timeout: aiohttp.ClientTimeout = CONTROL_TIMEOUT,
    ) -> dict:
        """One control call; its JSON object answer (plain text as `{"message": text}`).
        Raises SGLangError for a non-200 or `"success": false`."""
        kwargs = {"timeout": timeout}
        if body is not None:
            kwargs["json"] = body
        async with self.session.request(method, f"{self._url()}{path}", **kwargs) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise SGLangError(f"{path}: {error_message(resp.status, text)}", resp.status)
        try:
            data = json.loads(text) if text.strip() else {}
        except ValueError:
            return {"message": text}  # e.g. /flush_cache answers plain text
        if not isinstance(data, dict):
            raise SGLangBadResponse(f"{path}: expected a JSON object, got {text[:200]!r}")
        if data.get("success") is False:  # a failure must not pass for a 200
            raise SGLangError(f"{path}: {data.get('message', text)}", resp.status)
        return data

    async def get_either(self, path: str, older: str) -> dict:
        """GET `path`, or `older` where the server answers 404 (an endpoint renamed)."""
        try:
            return await self.request("GET", path)
        except SGLangError as exc:
            if exc.status != 404:
                raise
            return await self.request("GET", older)

    def abort_soon(self, rid: str) -> None:
        """Best effort: tell the server to drop a request whose caller went away."""
        if self.session is None or self.session.closed:
            return

        async def abort():
            url = f"{self._url()}/abort_request"
            try:
                async with self.session.post(url, json=abort_body(rid)):
                    pass
            except (TimeoutError, aiohttp.ClientError):
                pass

        task = asyncio.get_running_loop().create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
