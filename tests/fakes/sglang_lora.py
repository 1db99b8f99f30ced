"""The LoRA routes of the SGLang HTTP fake (tests/fakes/sglang_server.py), as SGLang 0.5.23 has
them (tests/unit/test_sglang_contract.py checks the bodies and flags against the package):

- LoRA needs `--enable-lora` at launch; `--max-lora-rank` and `--lora-target-modules` size the
  adapter pool, an adapter of a higher rank or other modules is refused at load
  (`LoRAManager.validate_new_adapter`), as is a name already loaded.
- `/load_lora_adapter {lora_name, lora_path}` and `/unload_lora_adapter {lora_name}` answer
  `LoRAUpdateOutput` (`success`, `error_message`, `loaded_adapters`), 400 on failure; a missing
  field is a 422. An unload waits for the requests still running under the adapter
  (`LoRARegistry.wait_for_unload`).
- `/generate` names an adapter in `lora_path`: without `--enable-lora` a 400; a name never
  loaded a 400; a name loaded once and unloaded since is loaded again from its path
  (`TokenizerManager._resolve_lora_path`).

The adapters are applied with peft (on a copy of the base: the served base stays as it is),
each request through its own adapter (`adapter_names`), so what the fake samples under an
adapter is what peft's model of that adapter samples.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from tests.fakes.sglang_rules import HttpError, json_body

BASE = "__base__"
"""peft's name for "no adapter" in a mixed batch."""


@dataclass(frozen=True)
class LoraFlags:
    """--enable-lora and the pool it sizes (None: not given)."""

    max_rank: int | None = None
    target_modules: tuple[str, ...] = ()


def lora_failure(message: str) -> HttpError:
    return HttpError(400, message, {"success": False, "error_message": message})


class LoraRoutes:
    """FakeSGLang's LoRA routes (a mixin: `self.lora` is the launch flags, None without
    --enable-lora; the state is set up by `_lora_init`)."""

    def _lora_init(self, flags: LoraFlags | None) -> None:
        self.lora = flags
        self.peft = None  # peft's model over a copy of the base, once an adapter is loaded
        self.adapters: dict[str, str] = {}  # loaded name -> path
        self.adapter_paths: dict[str, str] = {}  # every name ever loaded -> path
        self.adapter_users: Counter[str] = Counter()  # running requests per adapter
        self._peft_names: dict[str, str] = {}  # name -> peft's (no "." in a module name)
        self._peft_seq = itertools.count()

    # ---------------------------------------------------------------- routes
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await json_body(request, required=("lora_name", "lora_path"))
        self._check_enabled()
        await self._load_adapter(str(body["lora_name"]), str(body["lora_path"]))
        return self._lora_answer()

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await json_body(request, required=("lora_name",))
        self._check_enabled()
        name = str(body["lora_name"])
        if name not in self.adapters:
            raise lora_failure(
                f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}"
            )
        del self.adapters[name]  # no new request gets it; the running ones finish
        await self._wait_for(lambda: not self.adapter_users[name])
        self.peft.delete_adapter(self._peft_names.pop(name))
        if not self._peft_names:
            self.peft = None  # peft keeps a deleted adapter active: start afresh next time
        return self._lora_answer()

    # ---------------------------------------------------------------- generation
    async def resolve_adapter(self, name) -> str | None:
        """The adapter a /generate body names (`lora_path`), loaded again if it was unloaded."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise HttpError(400, "this fake serves one sample per request (lora_path a string)")
        if self.lora is None:
            raise HttpError(
                400,
                f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch "
                "the server with --enable-lora flag and preload adapters using --lora-paths "
                "or /load_lora_adapter endpoint.",
            )
        if name not in self.adapters:
            if name not in self.adapter_paths:
                raise HttpError(
                    400,
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: {list(self.adapter_paths)}.",
                )
            await self._load_adapter(name, self.adapter_paths[name])
        return name

    def forward(self, adapter: str | None, **inputs):
        """One forward of the served base, under `adapter` (None: the base)."""
        if self.peft is None or (not self.adapters and adapter is None):
            return self.model(**inputs)
        return self.peft(**inputs, adapter_names=[self._peft_names[adapter] if adapter else BASE])

    def base_swapped(self) -> None:
        """The base changed (/update_weights_from_disk): the adapters go onto the new one."""
        loaded, self.peft = dict(self.adapters), None
        self._peft_names.clear()
        for name, path in loaded.items():
            self._add(name, path)

    # ---------------------------------------------------------------- helpers
    def _check_enabled(self) -> None:
        if self.lora is None:
            raise lora_failure("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")

    async def _load_adapter(self, name: str, path: str) -> None:
        if name in self.adapters:
            raise lora_failure(f"Failed to load LoRA adapter {name} because it is already loaded")
        config_file = Path(path) / "adapter_config.json"
        if not config_file.is_file():
            raise lora_failure(f"Failed to load LoRA adapter {name}: no {config_file}")
        config = json.loads(config_file.read_text())
        rank, modules = int(config["r"]), set(config.get("target_modules") or ())
        pool = self.lora
        if (pool.max_rank is not None and rank > pool.max_rank) or (
            pool.target_modules
            and "all" not in pool.target_modules
            and not modules <= set(pool.target_modules)
        ):
            raise lora_failure(
                f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA "
                "memory pool configuration. Please ensure that the LoRA adapter's rank is "
                "within the configured `--max-lora-rank` and that the target modules are "
                "included in `--lora-target-modules`."
            )
        await asyncio.to_thread(self._add, name, path)
        self.adapters[name] = self.adapter_paths[name] = path

    def _add(self, name: str, path: str) -> None:
        from peft import PeftModel

        internal = self._peft_names[name] = f"adapter{next(self._peft_seq)}"
        if self.peft is None:
            base = copy.deepcopy(self.model)
            self.peft = PeftModel.from_pretrained(base, path, adapter_name=internal)
        else:
            self.peft.load_adapter(path, adapter_name=internal)
        self.peft.eval()

    def _lora_answer(self) -> web.Response:
        return web.json_response(
            {"success": True, "error_message": None, "loaded_adapters": dict(self.adapters)}
        )
