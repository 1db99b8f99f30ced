"""The rollout's long-lived loops go on after an unexpected error in one pass, logged as
`loop_error` (`asyncrl.logging.keep_running`): the torch engine's generation loop and the
managed SGLang child's watcher, each real (a tiny model; the fake SGLang server as the child).
Before, such an error ended the loop's task in silence: every later request waited forever,
a dead child was never restarted."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from structlog.testing import capture_logs

from asyncrl.natsutil import wait_until
from asyncrl.spec import SamplingParams
from asyncrl.tiny import build_tiny_model
from services.rollout import sglang_process, torch_engine
from services.rollout.engine import GenRequest
from services.rollout.sglang_config import SGLangConfig
from services.rollout.sglang_engine import SGLangEngine
from services.rollout.sglang_process import LaunchConfig
from services.rollout.torch_engine import TorchEngine
from tests.fakes.sglang_server import fake_launch_cmd

pytestmark = pytest.mark.slow  # deploys a model: left out of `make test-fast`


class BrokenOnce:
    """The module's logger, except that its first `method(event)` call raises (a log sink that
    failed): the error lands in the loop, outside any handler of its own."""

    def __init__(self, log, method: str, event: str):
        self._log, self._method, self._event = log, method, event
        self.raised = False

    def __getattr__(self, name):
        real = getattr(self._log, name)
        if name != self._method:
            return real

        def call(event, *args, **kwargs):
            if event == self._event and not self.raised:
                self.raised = True
                raise OSError(28, "No space left on device")
            return real(event, *args, **kwargs)

        return call


def _loop_errors(logs: list[dict], loop: str) -> list[dict]:
    return [e for e in logs if e["event"] == "loop_error" and e.get("loop") == loop]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("loops")
    build_tiny_model(root / "v0", seed=0)
    return str(root / "v0")


async def test_torch_engine_loop_goes_on_after_an_error_in_one_pass(model, monkeypatch):
    """A step fails, and logging that failure fails too: the pass raises. The loop logs it,
    runs the next pass, and the request is answered (it waited forever)."""
    broken = BrokenOnce(torch_engine.log, "exception", "step_failed")
    monkeypatch.setattr(torch_engine, "log", broken)
    engine = TorchEngine(seed=0)
    await engine.start()
    try:
        await engine.load(model, 0)
        real_run, failed = engine._run, []

        def run_failing_once(batch):
            if not failed:
                failed.append(len(batch))
                raise RuntimeError("CUDA error: an illegal memory access")
            return real_run(batch)

        engine._run = run_failing_once
        params = SamplingParams(temperature=0.0, max_new_tokens=4)
        with capture_logs() as logs:
            out = await asyncio.wait_for(engine.generate(GenRequest("r0", [10, 11], params)), 30)
    finally:
        await engine.stop()
    assert broken.raised and failed == [1]
    assert len(out.output_ids) == 4
    [error] = _loop_errors(logs, "torch_engine")
    assert error["error"] == "OSError: [Errno 28] No space left on device"


async def test_sglang_watcher_goes_on_after_an_error_in_one_pass(model, tmp_path, monkeypatch):
    """The child dies and logging it fails: the watcher logs the error, then restarts the
    child on its next pass (it ended, and the child stayed dead)."""
    broken = BrokenOnce(sglang_process.log, "warning", "sglang_died")
    monkeypatch.setattr(sglang_process, "log", broken)
    launch = LaunchConfig(launch_cmd=fake_launch_cmd(), log_path=str(tmp_path / "child.log"))
    engine = SGLangEngine(SGLangConfig(launch=launch, sglang_version="0.5.9"))
    await engine.start()
    try:
        await engine.load(model, 0)
        first_pid = engine.process.pid
        with capture_logs() as logs:
            os.kill(first_pid, signal.SIGKILL)
            await wait_until(lambda: engine.process.restarts == 1, timeout=60)
            await asyncio.wait_for(engine.process.ready.wait(), 60)
        pid, failure = engine.process.pid, engine.process.failure
        out = await engine.generate(
            GenRequest("r0", [1, 14, 15], SamplingParams(max_new_tokens=3), [2])
        )
    finally:
        await engine.stop()
    assert broken.raised and pid not in (None, first_pid)
    assert failure is None and len(out.output_ids) >= 1
    [error] = _loop_errors(logs, "sglang_watch")
    assert error["error"] == "OSError: [Errno 28] No space left on device"
