"""The SGLang engine: drives an SGLang server over its HTTP API (SGLang 0.4.10 - 0.5.23).

Two modes (`SGLangConfig`):
- attach (`url`): a server somebody else runs; we wait for `/health_generate`.
- launch (`launch`: a `LaunchConfig`): a managed child (`SGLangProcess`), started with the
  experiment's model on the first `load`, restarted if it dies, the current weights re-applied
  before it serves again.

Answers are checked: a 200 whose body breaks the API contract (no logprobs, ids that disagree)
raises `SGLangBadResponse`, never a silently wrong sample.

One `/generate` request per sample segment (`input_ids`, `return_logprob`, the sampling
params, stop token ids); its request id is unique and prefix-free (`wire_rid`: SGLang aborts by
prefix), its `max_new_tokens` clamped to the context the server reports (`GET /v1/models`);
sglang_protocol.py builds the bodies and says what the server refuses, sglang_client.py makes
the calls. The behaviour logprob of a token is SGLang's `output_token_logprobs` value: the
log-softmax of the logits divided by the temperature (SGLang's default; the managed child runs
with SGLANG_RETURN_ORIGINAL_LOGPROB=0), as the trainer recomputes it.

A weight update interrupts: `/pause_generation` (abort) -> the aborted requests come back with
their partial output -> `/update_weights_from_disk` (or the bucketed NCCL broadcast) ->
`/continue_generation`. From SGLang 0.5.21 the NCCL buckets are sent inside a weight-update
session (`/begin_weight_update` ... `/end_weight_update`, the end in a `finally`: a session left
open makes the next begin fail; one found open is closed and begun again). Each interrupted
sample is resubmitted as prompt + partial output with `max_new_tokens` reduced; every token
keeps the version that produced it. A sample whose server died mid-request is resubmitted the
same way once the server is back.

LoRA versions (`trainer.lora`): a launched child gets `--enable-lora` and the adapter flags of
the experiment (`serve_lora`; an attached server must have been started with them). An adapter
version is an interrupting update like a full one, pause -> `/load_lora_adapter` (a fresh
name per load, `adapter_name`) -> continue, and every segment sent afterwards names it
(`lora_path`): the name is chosen once the update has finished, so a segment's tokens carry
the version of the adapter it named (not the server's `weight_version`, the base's). The newest
`adapter_keep` (eta + 1) adapters stay loaded, older ones are unloaded; a restarted child gets
the current adapter loaded again before it serves.

Versions differ: SGLang >= 0.5.1 reports `weight_version` per response, older
ones do not, so the version is tracked here: new segments wait while an update runs and the
update waits (drain_timeout_s) for the aborted responses before it swaps, so a response's
version is the version served when it arrives. `/pause_generation` takes `{"mode": "abort"}`
from 0.5.5 on (no body before), model info is `/model_info` from 0.5.9 (`/get_model_info`
before).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import time
from dataclasses import replace
from typing import Any

import aiohttp

from asyncrl.logging import get_logger
from asyncrl.spec import LoraSpec
from asyncrl.types import Completion
from services.rollout.adapters import is_adapter_dir
from services.rollout.engine import Engine, GenRequest, UpdatePhases
from services.rollout.sglang_client import SGLangClient
from services.rollout.sglang_config import SGLangConfig
from services.rollout.sglang_lora import ServerAdapters
from services.rollout.sglang_process import (
    LoraLaunch,
    SGLangNotInstalled,
    SGLangProcess,
    installed_sglang_version,
    parse_version,
    sglang_launchable,
    wait_healthy,
)
from services.rollout.sglang_protocol import (  # noqa: F401 - re-exported
    InvalidSampling,
    PromptTooLong,
    ServerApi,
    SGLangBadResponse,
    SGLangError,
    abort_body,
    continue_body,
    disk_update_body,
    error_message,
    generate_body,
    init_group_body,
    parse_context_length,
    parse_generate_response,
    parse_json,
    wire_rid,
)
from services.rollout.sglang_sync import fetch_plan, receive_version

log = get_logger(component="sglang_engine")

UPDATE_TIMEOUT = aiohttp.ClientTimeout(total=1800)
GENERATE_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30)


class SGLangUnavailable(RuntimeError):
    """The server is down and did not come back in time."""


class SGLangEngine(Engine):
    name = "sglang"

    @classmethod
    def from_options(cls, **opts: Any) -> SGLangEngine:
        """From the flat `--engine-opt key=value` options (`SGLangConfig.from_options`)."""
        return cls(SGLangConfig.from_options(**opts))

    def __init__(self, config: SGLangConfig):
        """Raises SGLangNotInstalled when asked to launch `sglang.launch_server` on a machine
        without it (a `launch_cmd` replaces it)."""
        version = config.sglang_version
        if config.launch is not None and config.launch.launch_cmd is None:
            if not sglang_launchable():
                raise SGLangNotInstalled()
            version = version or installed_sglang_version()
        self.config = config
        self.url = config.url.rstrip("/") if config.url else None
        self.launch_cfg = replace(config.launch) if config.launch else None
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.device_name = (
            f"sglang at {self.url}" if self.url else f"sglang child, GPUs {gpus or 'all'}"
        )
        """The managed child's launch config as last launched (None when attached)."""
        self.api = ServerApi(parse_version(version)) if version else None
        self.process: SGLangProcess | None = None
        self.http = SGLangClient(lambda: self.url_now)
        self._request = self.http.request  # the control calls (pause, update, continue)
        self._version = 0
        self._weights: tuple[str, int] | None = None  # what the server serves (dir, version)
        self._group_ready = False
        self._serving = asyncio.Event()  # cleared while a weight update runs
        self._serving.set()
        self._update_lock = asyncio.Lock()
        self._updates = 0  # weight updates started; an abort is expected when it moved
        self._inflight: dict[str, asyncio.Future] = {}  # segment rid -> done when answered
        self._running = 0
        self._down = False  # attach mode: a connection failed; wait for health first
        self._rid_seq = itertools.count()  # numbers every request id sent (wire_rid)
        self.context_len: int | None = None  # as the server reports it (None: not reported)
        self.adapters = ServerAdapters(self._request, UPDATE_TIMEOUT)

    # ---------------------------------------------------------------- contract
    @property
    def version(self) -> int:
        return self._version

    @property
    def running(self) -> int:
        return self._running

    async def start(self) -> None:
        self.http.open()
        if self.url:
            await wait_healthy(self.url, self.config.startup_timeout_s)
            await self._detect_api()
            await self._read_context()
        elif self.launch_cfg.model_path:
            await self._launch(self.launch_cfg.model_path, None)

    async def stop(self) -> None:
        if self.process:
            await self.process.stop()
            self.process = None
        await self.http.close()

    def serve_lora(self, lora: LoraSpec | None, keep: int) -> None:
        """A launched child serves adapters with the experiment's rank and modules (it is
        launched again on the next `load` if its flags differ)."""
        super().serve_lora(lora, keep)
        if self.launch_cfg is not None:
            flags = None
            if lora is not None:
                modules = tuple(lora.target_modules)
                flags = LoraLaunch(
                    max_rank=lora.rank, target_modules=modules, max_per_batch=keep + 1
                )
            self.launch_cfg = replace(self.launch_cfg, lora=flags)

    async def load(self, model_dir: str, version: int) -> None:
        """Serve `model_dir` as `version`: (re)launch the managed child on a new model (or new
        LoRA flags), else load the weights into the running server. No adapter stays."""
        model_dir = str(model_dir)
        await self.adapters.clear()
        launched = self.process.cfg if self.process else None
        if self.launch_cfg is not None and (
            launched is None
            or launched.model_path != model_dir
            or launched.lora != self.launch_cfg.lora
        ):
            if self.process:
                await self.process.stop()
                self.process = None
            await self._launch(model_dir, version)
            return
        if self._weights == (model_dir, version):
            return
        if launched is not None and self._weights is None:
            self._weights, self._version = (model_dir, version), version  # launched with it
            return
        async with self._update_lock:
            await self._apply_from_disk(model_dir, version)

    async def update_weights(self, model_dir: str, version: int) -> int:
        """pause (abort) -> update -> continue. Returns how many requests were interrupted.
        A failed update raises SGLangError; the old weights keep serving."""
        model_dir = str(model_dir)
        async with self._update_lock:
            for attempt in itertools.count():
                await self._wait_server()
                self._serving.clear()
                self._updates += 1
                pending = list(self._inflight.values())
                try:
                    self.last_update = await self._pause_apply_continue(model_dir, version, pending)
                except aiohttp.ClientConnectionError:
                    self._down = True
                    if self.process is None:
                        raise
                    log.warning("server_lost_during_update", version=version)
                    # the managed child restarts (its watcher may not have seen the death yet:
                    # back off rather than spin); then update it again
                    await asyncio.sleep(min(0.05 * 2**attempt, 2.0))
                    continue
                finally:
                    self._serving.set()
                await self.adapters.keep(self.adapter_keep)
                log.info("weights_updated", version=version, interrupted=len(pending))
                return len(pending)

    async def _pause_apply_continue(
        self, model_dir: str, version: int, pending: list[asyncio.Future]
    ) -> UpdatePhases:
        """One update attempt, timed: pause and wait for the aborted requests' partial answers,
        load the weights (from disk, or received over the weight-update group), continue."""
        t0 = time.perf_counter()
        await self._pause()
        try:
            if pending:  # the aborted requests answer with their partial output
                _, late = await asyncio.wait(pending, timeout=self.config.drain_timeout_s)
                if late:
                    log.warning("abort_drain_timeout", late=len(late))
            paused = time.perf_counter()
            if is_adapter_dir(model_dir):
                await self.adapters.load(model_dir, version)
                self._version = version
            elif self.config.weight_sync == "nccl":
                await self._apply_distributed(model_dir, version)
            else:
                await self._apply_from_disk(model_dir, version)
            loaded = time.perf_counter()
        finally:
            await self._continue()
        return UpdatePhases(
            pause_s=paused - t0, load_s=loaded - paused, resume_s=time.perf_counter() - loaded
        )

    async def generate(self, req: GenRequest) -> Completion:
        p = req.params
        stop_ids = sorted(set(req.stop_token_ids) | set(p.stop_token_ids))
        out_ids: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        segment = 0
        finish = "length"
        lost_since: float | None = None  # first of consecutive connection failures
        loop = asyncio.get_running_loop()
        self._running += 1
        try:
            while len(out_ids) < p.max_new_tokens:
                full = self.context_len and len(req.input_ids) + len(out_ids) >= self.context_len
                if out_ids and full:
                    break  # the resumed sample fills the model's context: "length"
                rid = wire_rid(req.rid, segment, next(self._rid_seq))
                body = functools.partial(
                    generate_body, req, rid, out_ids, stop_ids, self.context_len
                )
                segment += 1
                try:
                    ids, seg_lps, finish, version = await self._generate_segment(rid, body)
                except aiohttp.ClientConnectionError as exc:
                    # The server died (a managed child is being restarted) or the network
                    # failed: resubmit prompt + the tokens we have once it answers again.
                    lost_since = lost_since or loop.time()
                    if loop.time() - lost_since > self.config.startup_timeout_s:
                        raise SGLangUnavailable(f"/generate {rid}: {exc}") from exc
                    log.warning("generate_connection_lost", rid=rid, error=str(exc))
                    await asyncio.sleep(min(0.05 * 2**segment, 2.0))
                    await self._wait_server()
                    continue
                lost_since = None
                out_ids += ids
                lps += seg_lps
                versions += [version] * len(ids)
                if finish != "abort":
                    break
                if ids and ids[-1] in stop_ids:
                    finish = "stop"
                    break
            else:
                finish = "length"
            if finish not in ("stop", "length"):
                finish = "length"
            return Completion(
                output_ids=out_ids,
                logprobs=lps,
                versions=versions,
                finish_reason=finish,
                interruptions=segment - 1,
            )
        finally:
            self._running -= 1

    # ---------------------------------------------------------------- generation
    async def _generate_segment(self, rid: str, build):
        """One /generate call, its body `build(adapter=...)` once no update runs. Returns (ids,
        logprobs, finish, the version that generated them). An abort is a result only when a
        weight update caused it."""
        while not self._serving.is_set() or self._server_waiting():
            await self._serving.wait()
            await self._wait_server()
        body = build(adapter=self.adapters.current)
        adapter_version = self.adapters.version
        updates = self._updates
        done = asyncio.get_running_loop().create_future()
        self._inflight[rid] = done
        try:
            async with self.http.session.post(
                f"{self.url_now}/generate", json=body, timeout=GENERATE_TIMEOUT
            ) as resp:
                text = await resp.text()
                served = self._version
                if resp.status != 200:
                    raise SGLangError(
                        f"/generate {rid}: {error_message(resp.status, text)}", resp.status
                    )
        except aiohttp.ClientConnectionError:
            self._down = True
            raise
        except asyncio.CancelledError:
            self.http.abort_soon(rid)
            raise
        finally:
            self._inflight.pop(rid, None)
            done.set_result(None)
        try:
            ids, lps, finish, meta = parse_generate_response(parse_json(text))
            asked = body["sampling_params"]["max_new_tokens"]
            if len(ids) > asked:
                raise SGLangBadResponse(f"{len(ids)} tokens, max_new_tokens was {asked}")
        except SGLangBadResponse as exc:
            raise SGLangBadResponse(f"/generate {rid}: {exc}") from None
        if finish == "abort" and self._serving.is_set() and self._updates == updates:
            reason = (meta.get("finish_reason") or {}).get("message", "aborted by the server")
            raise SGLangError(f"/generate {rid}: aborted outside a weight update: {reason}")
        if adapter_version is not None:
            return ids, lps, finish, adapter_version
        return ids, lps, finish, self._segment_version(meta, served)

    def _segment_version(self, meta: dict, served: int) -> int:
        reported = meta.get("weight_version")
        if reported is not None:
            try:
                return int(reported)
            except (TypeError, ValueError):
                pass  # e.g. "default": the server was not launched with a version
        return served

    # ---------------------------------------------------------------- server control
    @property
    def url_now(self) -> str:
        return self.url or self.process.url

    async def _launch(self, model_dir: str, version: int | None) -> None:
        self.launch_cfg = replace(self.launch_cfg, model_path=model_dir, weight_version=version)
        if self.api is None:
            self.api = ServerApi(parse_version(installed_sglang_version() or "0.5.9"))
        self.process = SGLangProcess(
            self.launch_cfg,
            self.api.version,
            on_restart=self._reapply,
            startup_timeout_s=self.config.startup_timeout_s,
        )
        await self.process.start()
        if self.launch_cfg.launch_cmd and not self.config.sglang_version:
            self.api = None  # not sglang.launch_server: the version its server reports
            await self._detect_api()
        await self._read_context()
        if version is not None:
            self._weights = (model_dir, version)
            self._version = version
        log.info("sglang_launched", url=self.process.url, model=model_dir, version=version)

    async def _reapply(self) -> None:
        """After a restart: the child serves its launch model and no adapter; put the current
        weights (and adapter) back."""
        self._group_ready = False  # the collective group died with the old server
        launched = (self.launch_cfg.model_path, self.launch_cfg.weight_version)
        if self._weights and self._weights != launched:
            model_dir, version = self._weights
            await self._update_from_disk(model_dir, version)
            log.info("weights_reapplied", model=model_dir, version=version)
        await self.adapters.reload()

    def _server_waiting(self) -> bool:
        """True when the server is (or may be) down and `_wait_server` would block."""
        if self.process is not None:
            return not self.process.ready.is_set()
        return self._down or not self.url

    async def _wait_server(self) -> None:
        """Return once the server can take requests (the managed child restarted, or the
        attached server answers its health check again)."""
        if self.process is not None:
            if not self.process.ready.is_set():
                await asyncio.wait_for(self.process.ready.wait(), self.config.startup_timeout_s)
            if self.process.failure:
                raise SGLangUnavailable(
                    f"SGLang server could not be restarted: {self.process.failure}"
                )
        elif self.url:
            if self._down:
                try:
                    await wait_healthy(self.url, self.config.startup_timeout_s)
                except TimeoutError as exc:
                    raise SGLangUnavailable(str(exc)) from exc
                self._down = False
        elif self.http.session is None:
            raise RuntimeError("sglang engine stopped")
        else:
            raise RuntimeError("no model loaded: call load() first")

    async def _detect_api(self) -> None:
        """The attached server's version, once (`/get_server_info`, `/server_info` on 404)."""
        if self.api is not None:
            return
        info = await self.http.get_either("/get_server_info", "/server_info")
        self.api = ServerApi(parse_version(str(info.get("version", "0.4.0"))))
        log.info("sglang_version", url=self.url_now, version=".".join(map(str, self.api.version)))

    async def _read_context(self) -> None:
        """The context length requests are clamped to (`GET /v1/models`), None if unknown."""
        try:
            self.context_len = parse_context_length(await self._request("GET", "/v1/models"))
        except SGLangError as exc:
            log.warning("sglang_context_unknown", error=str(exc))
            self.context_len = None

    async def model_info(self) -> dict:
        return await self.http.get_either(*self.api.model_info_paths)

    async def _pause(self) -> None:
        await self._request("POST", "/pause_generation", self.api.pause_body)

    async def _continue(self) -> None:
        await self._request("POST", "/continue_generation", continue_body())

    async def _update_from_disk(self, model_dir: str, version: int) -> None:
        body = disk_update_body(model_dir, version, self.api)
        await self._request("POST", "/update_weights_from_disk", body, timeout=UPDATE_TIMEOUT)

    async def _apply_from_disk(self, model_dir: str, version: int) -> None:
        await self._update_from_disk(model_dir, version)
        self._weights = (model_dir, version)
        self._version = version

    async def _apply_distributed(self, model_dir: str, version: int) -> None:
        """The engine's half of the collective update (sglang_sync.receive_version): the plan
        from the trainer's store, then one call per bucket."""
        c = self.config
        if not self.api.takes_flattened_buckets:
            raise SGLangError(
                "weight_sync nccl sends flattened buckets, which SGLang takes from 0.5.6 on; "
                f"this server is {'.'.join(map(str, self.api.version))}: use weight_sync disk"
            )
        if not self._group_ready:
            body = init_group_body(
                c.nccl_master, c.nccl_rank_offset, c.nccl_world, c.nccl_group, c.nccl_backend
            )
            await self._request("POST", "/init_weights_update_group", body, timeout=UPDATE_TIMEOUT)
            self._group_ready = True
        timeout_s = UPDATE_TIMEOUT.total
        try:
            plan = await asyncio.to_thread(
                fetch_plan, c.nccl_master, c.nccl_group, version, timeout_s
            )
        except (RuntimeError, ValueError) as exc:  # the store's timeout, a plan we cannot take
            raise SGLangError(f"v{version}: no bucket plan from the trainer: {exc}") from exc
        await receive_version(
            functools.partial(self._request, timeout=UPDATE_TIMEOUT),
            plan,
            group=c.nccl_group,
            weight_version=version if self.api.reports_weight_version else None,
            session=self.api.needs_update_session,
        )
        self._weights = (model_dir, version)  # a restart reloads this version from disk
        self._version = version
