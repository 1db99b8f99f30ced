"""A managed SGLang server: the launch command, the child process, restart when it dies.

`SGLangProcess` starts `python -m sglang.launch_server ...` (or, in tests, any command that
speaks the same HTTP API: `launch_cmd`) in its own process group, waits until
`GET /health_generate` answers 200, and watches it. When the child dies unexpectedly its whole
process group is killed (SGLang's scheduler and detokenizer are grandchildren), it is started
again on the same port, and `on_restart` runs before `ready` is set again: the engine uses it
to re-apply the weights it was serving.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import aiohttp

from asyncrl.logging import get_logger, keep_running
from asyncrl.net import free_port

log = get_logger(component="sglang_process")
WATCH_RETRY_S = 1.0
"""Pause before the watcher's next pass after one that raised (`keep_running`)."""

SGLANG_MISSING = (
    "sglang is not installed: pip install 'sglang[all]' on a CUDA machine, or use --sglang-url "
    "to attach to a running server, or rollout.engine: torch"
)

# Environment for the child. SGLang's default behaviour logprobs are temperature-scaled, as the
# trainer (and the torch engine) compute them: make sure an inherited RETURN_ORIGINAL_LOGPROB
# (the unscaled log-softmax) does not change that. Both spellings: older 0.5.x read the second.
CHILD_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0", "RETURN_ORIGINAL_LOGPROB": "0"}


# Linux: the child runs through this exec shim, which asks the kernel to SIGTERM it when the
# rollout worker dies (PR_SET_PDEATHSIG survives exec), so a crashed worker leaves no SGLang
# server holding the GPU (SGLang's own processes follow their parent). A preexec_fn would need
# no shim but is unsafe in a process with threads (gRPC's): the forked children crashed.
_PDEATHSIG_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)  # the worker died before prctl\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(cmd: list[str]) -> list[str]:
    """`cmd`, exec'd by a shim that makes it get SIGTERM when this process dies (Linux only;
    the child must be spawned from a thread that lives as long as the process)."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid()), *cmd]


class SGLangNotInstalled(RuntimeError):
    """Launch mode was asked for on a machine without the `sglang` package."""

    def __init__(self):
        super().__init__(SGLANG_MISSING)


class ChildExited(RuntimeError):
    """The SGLang child process exited before it became healthy."""


def parse_version(text: str | None) -> tuple[int, int, int]:
    """'0.5.1rc0' -> (0, 5, 1); None or garbage -> (0, 0, 0)."""
    nums = [int(n) for n in re.findall(r"\d+", text or "")[:3]]
    return tuple(nums + [0] * (3 - len(nums)))  # type: ignore[return-value]


def installed_sglang_version() -> str | None:
    """The version of the importable `sglang` package, or None when it is not installed."""
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def sglang_launchable() -> bool:
    """`sglang.launch_server` can start here: sglang and its GPU runtime (triton) are
    importable. (The test venv has sglang without its dependencies, for the contract test.)"""
    return installed_sglang_version() is not None and importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class LoraLaunch:
    """The LoRA flags of a server that serves adapters: `--enable-lora --max-lora-rank R
    --lora-target-modules M... --max-loras-per-batch N` (SGLang sizes its adapter memory pool
    by them at launch; an adapter of a higher rank or other modules is refused at load)."""

    max_rank: int
    target_modules: tuple[str, ...]
    max_per_batch: int = 8
    """Adapters in one running batch, the base counting as one (SGLang's default 8)."""

    def argv(self) -> list[str]:
        return [
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_rank),
            "--lora-target-modules",
            *self.target_modules,
            "--max-loras-per-batch",
            str(self.max_per_batch),
        ]


@dataclass
class LaunchConfig:
    """How to start the SGLang server (the `--engine-opt` launch options are its fields, but
    `weight_version` and `lora`, which the engine sets)."""

    model_path: str = ""
    """HuggingFace model directory served first; empty: launch on the experiment's first
    `load`, with its model."""
    host: str = "127.0.0.1"
    """Interface the server listens on (`--host`)."""
    port: int = 0
    """`--port`; 0: pick a free port at launch; restarts reuse it so the URL stays the same."""
    tp_size: int = 1
    """Tensor-parallel GPUs of this server (`--tp-size`)."""
    mem_fraction: float = 0.8
    """Fraction of GPU memory for weights + KV cache (`--mem-fraction-static`)."""
    random_seed: int = 1
    """`--random-seed`."""
    weight_version: int | None = None
    """Version label of `model_path` (`--weight-version`, SGLang >= 0.5.1)."""
    lora: LoraLaunch | None = None
    """LoRA serving, from the bound experiment's `trainer.lora` (`SGLangEngine.serve_lora`)."""
    extra_args: list[str] = field(default_factory=list)
    """More `sglang.launch_server` flags, passed through verbatim."""
    launch_cmd: list[str] | None = None
    """Replaces `python -m sglang.launch_server` (tests launch the HTTP fake this way)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the child (on top of this process's and CHILD_ENV), e.g.
    CUDA_VISIBLE_DEVICES."""
    log_path: str | None = None
    """File the child's stdout and stderr are appended to; None: inherit this process's."""


def build_command(cfg: LaunchConfig, sglang_version: tuple[int, int, int]) -> list[str]:
    """The child's argv for `cfg` against an SGLang of `sglang_version`."""
    cmd = list(cfg.launch_cmd or [sys.executable, "-m", "sglang.launch_server"])
    cmd += [
        "--model-path",
        cfg.model_path,
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--tp-size",
        str(cfg.tp_size),
        "--mem-fraction-static",
        str(cfg.mem_fraction),
        "--random-seed",
        str(cfg.random_seed),
        "--skip-server-warmup",
    ]
    if cfg.weight_version is not None and sglang_version >= (0, 5, 1):
        cmd += ["--weight-version", str(cfg.weight_version)]
    if cfg.lora is not None:
        cmd += cfg.lora.argv()
    return cmd + list(cfg.extra_args)


async def wait_healthy(
    url: str, timeout_s: float, proc: asyncio.subprocess.Process | None = None
) -> None:
    """Poll `GET {url}/health_generate` until it answers 200 (503 and refused connections
    mean "still starting"). Raises ChildExited if `proc` exits, TimeoutError after timeout_s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = 0.1
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while True:
            if proc is not None and proc.returncode is not None:
                raise ChildExited(
                    f"SGLang server exited with code {proc.returncode} before it became healthy"
                )
            try:
                async with session.get(f"{url}/health_generate") as resp:
                    if resp.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"SGLang server at {url} not healthy after {timeout_s:.0f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 2.0)


class SGLangProcess:
    """One supervised SGLang server child."""

    def __init__(
        self,
        cfg: LaunchConfig,
        sglang_version: tuple[int, int, int],
        *,
        on_restart: Callable[[], Awaitable[None]] | None = None,
        startup_timeout_s: float = 900.0,
        max_restarts: int = 5,
    ):
        self.cfg = replace(cfg, port=cfg.port or free_port(cfg.host))
        self.sglang_version = sglang_version
        self.on_restart = on_restart
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.ready = asyncio.Event()
        """Set while the server is up and serving the engine's current weights."""
        self.restarts = 0
        self.failure: BaseException | None = None
        """Why supervision gave up (set together with `ready`, so waiters wake up)."""
        self._proc: asyncio.subprocess.Process | None = None
        self._watcher: asyncio.Task | None = None
        self._stopping = False

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def start(self) -> None:
        """Start the child and return once it is healthy (raises if it does not get there)."""
        self._stopping = False
        await self._spawn_until_healthy()
        self.ready.set()
        self._watcher = asyncio.create_task(self._watch(), name="sglang-watch")

    async def stop(self) -> None:
        self._stopping = True
        self.ready.clear()
        if self._watcher:
            self._watcher.cancel()
            try:
                await self._watcher
            except asyncio.CancelledError:
                pass
            self._watcher = None
        await self._kill(graceful=True)

    async def _spawn(self) -> None:
        cmd = build_command(self.cfg, self.sglang_version)
        out = open(self.cfg.log_path, "ab") if self.cfg.log_path else None  # noqa: SIM115
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *die_with_parent(cmd),
                stdout=out,
                stderr=out,
                start_new_session=True,
                env={**os.environ, **CHILD_ENV, **self.cfg.env},
            )
        finally:
            if out:
                out.close()  # the child holds its own descriptor
        log.info("sglang_started", pid=self._proc.pid, url=self.url, cmd=" ".join(cmd))

    async def _spawn_until_healthy(self) -> None:
        await self._spawn()
        try:
            await wait_healthy(self.url, self.startup_timeout_s, self._proc)
        except BaseException:
            await self._kill(graceful=False)
            raise

    async def _kill(self, graceful: bool) -> None:
        """Kill the child's whole process group (SGLang forks scheduler/detokenizer)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        sig = signal.SIGTERM if graceful and proc.returncode is None else signal.SIGKILL
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            await asyncio.wait_for(proc.wait(), timeout=15 if sig == signal.SIGTERM else 5)
        except TimeoutError:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
        if sig == signal.SIGTERM:  # leftovers of the group, if any
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def _watch(self) -> None:
        """Restart the child whenever it dies (`_watch_once`), until stopped or given up; an
        error a pass did not handle is logged and the next pass runs, never ending the
        supervision in silence."""
        await keep_running(
            "sglang_watch",
            self._watch_once,
            log,
            retry_s=WATCH_RETRY_S,
            until=lambda: self._stopping or self.failure is not None,
        )

    async def _watch_once(self) -> None:
        """Wait for the child to die (it is dead already when a pass before failed midway),
        then restart it; give up after max_restarts failed starts."""
        code = await self._proc.wait() if self._proc is not None else None
        if self._stopping:
            return
        self.ready.clear()
        log.warning("sglang_died", code=code, url=self.url)
        await self._kill(graceful=False)
        failures = 0
        while True:
            self.restarts += 1
            try:
                await self._spawn_until_healthy()
                if self.on_restart:
                    await self.on_restart()
                break
            except Exception as exc:  # noqa: BLE001 - retried, then reported via failure
                failures += 1
                log.warning("sglang_restart_failed", attempt=failures, error=str(exc))
                await self._kill(graceful=False)
                if failures >= self.max_restarts:
                    self.failure = exc
                    self.ready.set()  # wake waiters; they check `failure`
                    return
                await asyncio.sleep(min(2.0**failures, 30.0))
        log.info("sglang_restarted", restarts=self.restarts, pid=self.pid)
        self.ready.set()
