"""Zero-cost stand-ins for the control-plane benchmark: an engine that answers at once and a
trainer backend whose step does nothing, so that what a deployment spends is the control plane.

    python -m bench.zero rollout --engine torch ...    # services.rollout, engine -> ZeroEngine
    python -m bench.zero trainer ...                   # services.trainer, backend -> NoopBackend
    python -m bench.zero scheduler|reward ...          # the service as is

Neither is a product choice: nothing in `asyncrl.registry` names them. This entry point puts
them behind the names `torch` (engine and trainer backend) in its own process only, then runs
the service's own `__main__`; the spec, the scheduler and every other process see a torch
experiment. With ASYNCRL_BENCH_PROFILE=DIR set, the main thread is profiled between SIGUSR1 and
SIGUSR2 (the benchmark's steady window) into DIR/<service>.prof; the Python threads it ran
(the asyncio executor: weight publishing, checkpoints), over their whole life, into
DIR/<service>-threads.prof on a clean exit (SIGTERM). ASYNCRL_BENCH_PATCH=mod1,mod2 imports
those modules first and calls their `apply(service)`: what-if experiments with an
optimisation, the services left as they are.
"""

from __future__ import annotations

import cProfile
import gc
import importlib
import json
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

from asyncrl.registry import ENGINES, TRAINER_BACKENDS
from asyncrl.types import Completion, TrajectoryGroup
from services.rollout.engine import Engine, GenRequest
from services.trainer.backends.base import TrainerBackend

PROFILE_ENV = "ASYNCRL_BENCH_PROFILE"
PATCH_ENV = "ASYNCRL_BENCH_PATCH"
"""Comma-separated modules imported first, each `apply(service)` called: a what-if experiment
(an optimisation tried on the deployment without editing the services)."""
SERVICES = ("scheduler", "reward", "rollout", "trainer")
FIRST_TOKEN = 4
"""The character tokenizer's first printable character ("0"): outputs stay inside any vocab."""


class ZeroEngine(Engine):
    """Every request is answered at once with `output_len` tokens (the digits, cycled), logprob
    -1 each, stamped with the version served."""

    name = "zero"

    def __init__(self, output_len: int = 16, **_ignored):
        self.output_len = int(output_len)
        self._version = 0
        self._ids = [FIRST_TOKEN + i % 10 for i in range(self.output_len)]

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def load(self, model_dir: str, version: int) -> None:
        self._version = version

    async def update_weights(self, model_dir: str, version: int) -> int:
        self._version = version
        return 0

    async def generate(self, req: GenRequest) -> Completion:
        return self._answer(req)

    async def generate_many(self, reqs: list[GenRequest]) -> list[Completion]:
        """At once, as `generate` (the torch engine queues a group's requests in one call)."""
        return [self._answer(req) for req in reqs]

    def _answer(self, req: GenRequest) -> Completion:
        n = min(self.output_len, req.params.max_new_tokens)
        return Completion(
            output_ids=self._ids[:n],
            logprobs=[-1.0] * n,
            versions=[self._version] * n,
            finish_reason="length",
        )


class NoopBackend(TrainerBackend):
    """Consumes the batch and does nothing; its "weights" are the model's config.json (what a
    rollout checks before it loads a version)."""

    def load(self, model_dir: str) -> None:
        self.config = (Path(model_dir) / "config.json").read_bytes()

    def train_step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        tokens = sum(len(s.output_ids) for g in groups for s in g.samples)
        return {"loss": 0.0, "tokens": float(tokens)}

    def save_hf(self, out_dir: Path) -> None:
        (Path(out_dir) / "config.json").write_bytes(self.config)

    def hf_files(self) -> dict[str, bytes]:
        """In memory, as the torch and megatron backends take theirs (not the base class's
        default: save_hf into a temporary directory and read it back)."""
        return {"config.json": self.config}

    def save_checkpoint(self, ckpt_dir: Path) -> None:
        (Path(ckpt_dir) / "noop").write_bytes(b"")

    def load_checkpoint(self, ckpt_dir: Path) -> None:
        return None

    def logprobs(self, groups: list[TrajectoryGroup]) -> list[list[list[float]]]:
        return [[[-1.0] * len(s.output_ids) for s in g.samples] for g in groups]


def install() -> None:
    """In this process only: the names `torch` build the zero engine and the no-op backend."""
    ENGINES.entries["torch"] = "bench.zero:ZeroEngine"
    TRAINER_BACKENDS.entries["torch"] = "bench.zero:NoopBackend"


def _run_service(service: str) -> None:
    runpy.run_module(f"services.{service}", run_name="__main__", alter_sys=True)


class GcTime:
    """Wall time the cyclic garbage collector takes, per generation, since `reset` (cProfile
    charges a collection to whatever function allocated when it started)."""

    def __init__(self):
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def reset(self) -> None:
        self.seconds, self.collections = [0.0, 0.0, 0.0], [0, 0, 0]

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._t0
            self.collections[info["generation"]] += 1

    def totals(self) -> dict:
        return {"seconds": self.seconds, "collections": self.collections}


def _profiled(service: str, out: Path) -> None:
    """Run the service with cProfile ready: SIGUSR1 starts profiling the main thread (the event
    loop), SIGUSR2 stops it and writes DIR/<service>.prof. Every other Python thread runs under
    its own profiler from its start; their sum goes to DIR/<service>-threads.prof on exit.
    The garbage collector's time over the window goes to DIR/<service>.gc.json."""
    threads: list[cProfile.Profile] = []
    original_run = threading.Thread.run

    def run(self):
        prof = cProfile.Profile()
        threads.append(prof)
        prof.enable()
        try:
            original_run(self)
        finally:
            prof.disable()

    threading.Thread.run = run
    # the thread's CPU clock, not the wall clock: on a machine with more processes than cores
    # a wall-clock profile charges the time the process was preempted to whatever it was
    # running then (a 2 µs os.write read as 1.2 ms); the loop's idle wait costs ~nothing
    main = cProfile.Profile(time.thread_time)
    gc_time = GcTime()
    out.mkdir(parents=True, exist_ok=True)

    def start(signum, frame):
        gc_time.reset()
        main.enable()

    def stop(signum, frame):
        main.disable()
        (out / f"{service}.gc.json").write_text(json.dumps(gc_time.totals()))
        main.dump_stats(out / f"{service}.prof")

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    try:
        _run_service(service)
    finally:
        main.disable()
        if threads:
            import pstats

            stats = pstats.Stats(threads[0])
            for prof in threads[1:]:
                stats.add(prof)
            stats.dump_stats(out / f"{service}-threads.prof")


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in SERVICES:
        raise SystemExit(f"usage: python -m bench.zero {{{'|'.join(SERVICES)}}} [service args]")
    service, rest = argv[0], argv[1:]
    install()
    for name in filter(None, os.environ.get(PATCH_ENV, "").split(",")):
        importlib.import_module(name).apply(service)
    sys.argv = [f"services.{service}", *rest]
    profile_dir = os.environ.get(PROFILE_ENV)
    if profile_dir:
        _profiled(service, Path(profile_dir))
    else:
        _run_service(service)


if __name__ == "__main__":
    main(sys.argv[1:])
