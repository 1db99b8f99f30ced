"""The LoRA adapters an SGLang server holds for the engine (services/rollout/sglang_engine.py).

Each adapter version is loaded under a name of its own (`adapter_name`: SGLang refuses a name
in use, and a rewound run publishes a version number again); `current` is the one new segments
name, the newest `keep` stay loaded and older ones are unloaded (SGLang waits for the requests
still running under one before it unloads it).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable

import aiohttp

from asyncrl.logging import get_logger
from services.rollout.sglang_protocol import (
    SGLangError,
    adapter_name,
    lora_load_body,
    lora_unload_body,
)

log = get_logger(component="sglang_engine")

Request = Callable[..., Awaitable[object]]
"""The engine's control call: request(method, path, body, timeout=...)."""


class ServerAdapters:
    def __init__(self, request: Request, timeout: aiohttp.ClientTimeout):
        self._request = request
        self._timeout = timeout
        self.loaded: dict[str, tuple[int, str]] = {}  # name -> (version, dir), oldest first
        self.current: str | None = None  # what every new segment names (None: the base)
        self._loads = itertools.count()

    @property
    def version(self) -> int | None:
        """The version of the current adapter (None: no adapter, the base serves)."""
        return self.loaded[self.current][0] if self.current else None

    async def load(self, model_dir: str, version: int) -> None:
        """Load the LoRA version in `model_dir` under a new name and make it current."""
        name = adapter_name(version, next(self._loads))
        body = lora_load_body(name, model_dir)
        await self._request("POST", "/load_lora_adapter", body, timeout=self._timeout)
        self.loaded[name] = (version, model_dir)
        self.current = name

    async def keep(self, n: int) -> None:
        """Unload all but the newest `n` (n >= 1: the current one stays)."""
        await self._unload(list(self.loaded)[: -max(n, 1)])

    async def clear(self) -> None:
        """Unload every adapter: the base serves."""
        self.current = None
        await self._unload(list(self.loaded))

    async def reload(self) -> None:
        """After a server restart (it holds none): load the current adapter again."""
        current = self.loaded.get(self.current) if self.current else None
        self.loaded.clear()
        self.current = None
        if current is not None:
            version, model_dir = current
            await self.load(model_dir, version)
            log.info("adapter_reapplied", model=model_dir, version=version)

    async def _unload(self, names: list[str]) -> None:
        """A failure is logged: the server keeps that adapter, nothing else breaks."""
        for name in names:
            self.loaded.pop(name, None)
            try:
                await self._request("POST", "/unload_lora_adapter", lora_unload_body(name))
            except (SGLangError, aiohttp.ClientConnectionError) as exc:
                log.warning("adapter_unload_failed", adapter=name, error=str(exc))
