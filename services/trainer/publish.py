"""A trained version's way out, off the trainer's critical path.

After `train_step` the loop takes the weights as bytes (`TrainerBackend.hf_files`, a snapshot
no later step changes) and hands them over: `write_version` puts them in the weight store and
`CommitWeights` tells the scheduler, in a task beside the loop, while the next step is
collected and trained. `Publisher` is that task's work (written, sent the way
`trainer.weight_sync` says, committed, recorded trained in the ledger) and `InFlight` holds the
task: at most one version is in flight (the loop waits for the previous one before it hands over
the next, so commits stay in order and one version's bytes at most wait in memory), and its
failure is raised to the loop by `wait`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path

from asyncrl import fingerprint
from asyncrl.ledger import Ledger, sample_fingerprints
from asyncrl.types import StepMetrics, TrajectoryGroup
from asyncrl.weights import prune, publish_version, tokenizer_files, version_dir


def write_version(
    root: Path,
    experiment_id: str,
    version: int,
    files: dict[str, bytes],
    tokenizer_dir: Path,
    keep: int,
    last: int | None = None,
    weights_fingerprint: str | None = None,
) -> str:
    """`files` (+ the tokenizer's) as `version` in the weight store: written to a temporary
    directory and renamed into place, so a reader never sees it partial; the newest `keep`
    versions up to `version` are kept, and those above it removed (an abandoned lineage: a
    resumed trainer rewrites the version of its checkpoint, then trains on from there: see
    `prune`); the `last` version (`trainer.total_steps`: what the run ends on, what `asyncrl
    export` takes) is never removed for the count. Its manifest records the weights' fingerprint:
    `weights_fingerprint` when given (a streamed version's), else one sha256 pass over the
    tensors' bytes (`asyncrl.fingerprint`). A file's data is bytes, or a list of buffers
    written one after the other (a streamed version's buckets, not copied again). Returns the
    version's URI."""
    final = version_dir(root, experiment_id, version)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                for part in [data] if isinstance(data, bytes) else data:
                    f.write(part)
        fp = weights_fingerprint or fingerprint.of_files(files)
        fingerprint.write_manifest(tmp, version, fp)
        _add_tokenizer(Path(tokenizer_dir), version_dir(root, experiment_id, version - 1), tmp)
        uri = publish_version(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    protect = version_dir(root, experiment_id, last) if last is not None else None
    prune(root, experiment_id, keep=keep, newest=version, protect=protect)
    return uri


def _add_tokenizer(tokenizer_dir: Path, previous: Path, dst: Path) -> None:
    """The tokenizer's files into `dst`: hard links to those of the `previous` version where it
    has them (a version is never changed in place, so they hold the same bytes), else copies.
    A copy creates a file per tokenizer file per step: on the machine bench/control_plane.py
    ran on, ~340 CPU-µs each against 15 for a link."""
    for name in tokenizer_files(tokenizer_dir):
        src = tokenizer_dir / name
        try:
            os.link(previous / name, dst / name)
        except OSError:  # no previous version (the first, a rewind), another file system
            shutil.copy2(src, dst / name)


class InFlight:
    """The one version being published. `stage` names what it is doing (for a failure)."""

    def __init__(self):
        self._task: asyncio.Task | None = None
        self.stage = ""

    def start(self, coro: Coroutine) -> None:
        """Publish in the background; `wait()` for the previous version first."""
        assert self._task is None, "one version in flight at a time"
        self._task = asyncio.create_task(coro, name="publish-version")

    @property
    def done(self) -> bool:
        """Nothing in flight, or it ended (then `wait()` returns at once or raises)."""
        return self._task is None or self._task.done()

    async def wait(self) -> None:
        """Return once the version in flight (if any) is published; raise its failure. A failed
        publication stays failed: every later `wait()` raises it again."""
        task = self._task
        if task is None:
            return
        await asyncio.shield(task)
        if self._task is task:
            self._task = None

    def cancel(self) -> None:
        """Abandon the version in flight (the loop ends without it: a crash, or a failure)."""
        task, self._task = self._task, None
        if task is None:
            return
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved: the run's failure is reported elsewhere
        else:
            task.cancel()


class Publisher:
    """One run's versions on their way out: each written and sent (`sender`), committed
    (`commit`: `SchedulerCalls.commit`) and recorded `trained` in the ledger, one at a time in a
    task beside the loop (`start`; `wait` before the next). A stop in a commit's answer calls
    `on_stop`: the run ends at the next step boundary."""

    def __init__(
        self,
        sender,
        commit: Callable,
        ledger: Ledger,
        run_id: str,
        observe: Callable[[str, float], None],
        log,
        on_stop: Callable[[], None],
    ):
        self.sender = sender  # transport.WeightSender
        self._commit, self.ledger, self.run_id = commit, ledger, run_id
        self._observe, self.log, self._on_stop = observe, log, on_stop
        self.fingerprints: dict[int, str] = {}
        """Version -> the fingerprint of its weights, as written."""
        self.commit_s = 0.0
        """How long the last version's CommitWeights took (sent with the next step)."""
        self.moved = (0, 0)
        """The bytes the last version's broadcast moved, and its whole size (sent with the next
        step; `WeightSender.moved`)."""
        self._inflight = InFlight()

    @property
    def stage(self) -> str:
        """What the version in flight was doing (names a failure)."""
        return self._inflight.stage

    @property
    def done(self) -> bool:
        return self._inflight.done

    def start(self, m: StepMetrics, files: dict[str, bytes], groups: list[TrajectoryGroup]):
        """Publish version `m.version` (its weights `files`, trained on `groups`) beside the
        loop; `wait()` for the previous one first."""
        self._inflight.start(self._publish(m, files, groups))

    async def wait(self) -> None:
        await self._inflight.wait()

    def cancel(self) -> None:
        self._inflight.cancel()

    async def _publish(self, m: StepMetrics, files: dict[str, bytes], groups: list) -> None:
        self._inflight.stage = "publish weights"
        t0 = time.perf_counter()
        uri = await self.sender.publish(m.version, files)
        fp = self.fingerprints[m.version] = self.sender.fingerprint(m.version)
        t1 = time.perf_counter()
        m.write_s = t1 - t0
        self._observe("write", m.write_s)
        self._inflight.stage = "commit"
        commit = self._commit(uri, m, fp, self.sender.store_address)
        resp = await self.sender.send(m.version, commit)
        self.commit_s = time.perf_counter() - t1
        self.moved = self.sender.moved(m.version)
        self._observe("commit", self.commit_s)
        fields = {"run": self.run_id, "fingerprint": fp, **sample_fingerprints(groups)}
        # stored in the background, retried while NATS is away (`ledger_behind`)
        self.ledger.emit("trained", step=m.step, version=m.version, **fields)
        if resp.stop:
            self.log.info(
                "scheduler_says_stop", version=m.version, fleet_version=resp.fleet_version
            )
            self._on_stop()
