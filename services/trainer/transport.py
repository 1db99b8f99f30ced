"""How a trained version reaches the rollouts: one `WeightSender` per experiment, chosen by the
one knob `trainer.weight_sync` of the experiment spec (`sender_for`):

  disk  the version is written to the weight store; rollouts load its file:// URI (a
        filesystem they share with the trainer).
  nats  written there, then uploaded to the NATS object store (`asyncrl.weights_nats`);
        rollouts fetch its nats-obj:// URI into their own cache (no shared filesystem).
  broadcast  streamed from the trainer's parameters in buckets to the torch engines over one
        process group, the store written beside it from the same snapshot (`broadcast.py`).
  nccl  packed from the trainer's parameters into flat buckets, written there from them, and
        broadcast from them to the SGLang engines' GPUs, one broadcast per bucket (the trainer
        is rank 0 of their weight-update group, `weight_sync.py`) while the scheduler commits
        the version and has the engines receive it.

Every sender writes the weight store first: checkpoints and resume read it, and a restarted
engine reloads from it. The payload is the version's files as the backend serialised them
(`TrainerBackend.hf_files`: safetensors, a name -> tensor mapping, plus config.json, its
metadata), or, under `nccl` and `broadcast`, written from the bucket snapshot's buffers; a
LoRA adapter is the same call with adapter_model.safetensors and adapter_config.json.

`ASYNCRL_WEIGHTS_TRANSPORT=nats`, the former deployment-wide knob, is a deprecated alias: it
turns `disk` into `nats`, and under `nccl` sends the files through NATS too (what it did
before), with a warning naming the spec field to use.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from asyncrl.fingerprint import of_state, read_manifest
from asyncrl.retry import jetstream_call
from asyncrl.settings import settings
from asyncrl.spec import TrainerSpec
from asyncrl.weights import path_to_uri, prune, version_dir
from asyncrl.weights_nats import prune_versions, upload_version, uploaded, version_uri
from services.trainer.publish import write_version
from services.trainer.weight_sync import WeightBroadcaster

T = TypeVar("T")
Files = Mapping[str, bytes]
Observe = Callable[[str, float], None]
"""Records the seconds of a phase (`upload`) in the trainer's phase histogram."""


@dataclass(frozen=True, kw_only=True)
class Store:
    """One experiment's part of the trainer's weight store."""

    root: Path
    experiment_id: str
    tokenizer_dir: Path
    """Its tokenizer files go with every version."""
    keep: int
    """Versions kept (`keep_versions`): the newest ones, in the store and in the bucket."""
    final: int | None = None
    """The run's last version (`trainer.total_steps`): kept in the store however many follow."""

    def dir(self, version: int) -> Path:
        return version_dir(self.root, self.experiment_id, version)

    def write(self, version: int, files: Files, fingerprint: str | None = None) -> None:
        write_version(
            self.root,
            self.experiment_id,
            version,
            dict(files),
            self.tokenizer_dir,
            self.keep,
            last=self.final,
            weights_fingerprint=fingerprint,
        )

    def rewind(self, version: int) -> None:
        """The trainer resumed at `version`: the versions above it (an abandoned lineage) go."""
        prune(self.root, self.experiment_id, keep=self.keep, newest=version)


class WeightSender:
    """The trainer's side of the weights transport; the rollout's is
    `asyncrl.weights.WeightReceiver`."""

    name = ""

    def snapshot(self, backend):
        """The trained weights as `publish` takes them, a copy no later step changes (in the
        step's thread: the trainer's stall): the backend's files here."""
        return backend.hf_files()

    def uri(self, version: int) -> str:
        """What CommitWeights carries for `version`: where rollouts load it ("" for the base)."""
        raise NotImplementedError

    async def publish(self, version: int, files: Files) -> str:
        """Store `version` where the rollouts will get it; returns its URI."""
        raise NotImplementedError

    async def restore(self, version: int, files: Callable[[], Files]) -> None:
        """On resume: make the checkpoint's `version` available again (`files` serialises it,
        in a worker thread, when it has to be written)."""
        raise NotImplementedError

    def fingerprint(self, version: int) -> str:
        """The published `version`'s weights fingerprint, from its manifest in the weight store
        (every sender writes the store first); "" if it has none."""
        raise NotImplementedError

    async def send(self, version: int, commit: Awaitable[T]) -> T:
        """Deliver the published `version` while `commit` (CommitWeights) runs; returns its
        answer. Rollouts that load from the URI need nothing more than the commit."""
        return await commit

    def moved(self, version: int) -> tuple[int, int]:
        """The bytes `send` moved for `version` over a weight group, and what it would have
        moved whole; (0, 0) when none (the rollouts load from the URI)."""
        return 0, 0

    @property
    def store_address(self) -> str:
        """host:port of the store where the rollouts meet the trainer's weight group (each
        CommitWeights carries it: `broadcast`); "" when they meet none."""
        return ""

    async def close(self) -> None:
        """Leave whatever the sender joined (idempotent)."""


class DiskSender(WeightSender):
    """`disk`: the weight store, read through a shared filesystem."""

    name = "disk"

    def __init__(self, store: Store):
        self.store = store

    def uri(self, version: int) -> str:
        return path_to_uri(self.store.dir(version)) if version else ""

    async def publish(self, version: int, files: Files, fingerprint: str | None = None) -> str:
        """`fingerprint`: the weights', when known (else computed from `files`)."""
        await asyncio.to_thread(self.store.write, version, files, fingerprint)
        return self.uri(version)

    def fingerprint(self, version: int) -> str:
        return read_manifest(self.store.dir(version))

    async def restore(self, version: int, files: Callable[[], Files]) -> None:
        if not self.store.dir(version).exists():  # pruned after the checkpoint was taken
            await asyncio.to_thread(lambda: self.store.write(version, files()))
        else:
            await asyncio.to_thread(self.store.rewind, version)


class NatsSender(DiskSender):
    """`nats`: the weight store, each version then uploaded to the NATS object store."""

    name = "nats"

    def __init__(self, store: Store, js, observe: Observe, log):
        super().__init__(store)
        self.js, self.observe, self.log = js, observe, log

    def uri(self, version: int) -> str:
        return version_uri(self.store.experiment_id, version) if version else ""

    async def publish(self, version: int, files: Files, fingerprint: str | None = None) -> str:
        await super().publish(version, files, fingerprint)
        t0 = time.perf_counter()
        uri = await self._upload(version)
        self.observe("upload", time.perf_counter() - t0)
        return uri

    async def restore(self, version: int, files: Callable[[], Files]) -> None:
        await super().restore(version, files)
        if not await uploaded(self.js, self.store.experiment_id, version):  # a bucket lost
            await self._upload(version)
        else:
            await self._prune(version)

    async def _upload(self, version: int) -> str:
        """Upload `version` from the weight store and prune the bucket as the store is pruned;
        a put replaces and a prune is idempotent, so both are retried while NATS is away."""
        exp = self.store.experiment_id
        src = self.store.dir(version)
        uri = await jetstream_call(lambda: upload_version(self.js, src, exp, version))
        await self._prune(version)
        self.log.info("weights_uploaded", version=version, uri=uri)
        return uri

    async def _prune(self, newest: int) -> None:
        exp, keep, final = self.store.experiment_id, self.store.keep, self.store.final
        await jetstream_call(
            lambda: prune_versions(self.js, exp, keep, newest=newest, protect=final)
        )


class NcclSender(WeightSender):
    """`nccl`: a snapshot of the trainer's parameters in packed buckets (`weight_sync.py`),
    stored as `files` does it (written from the snapshot's buffers), and broadcast from them to
    the engines beside the commit, one broadcast per bucket."""

    name = "nccl"

    def __init__(self, files: DiskSender, broadcaster: WeightBroadcaster):
        self.files, self.broadcaster = files, broadcaster
        self._snaps: dict = {}  # version -> its Snapshot, until sent

    def snapshot(self, backend):
        state, config = backend.hf_state()
        return self.broadcaster.snapshot(state, config)

    def uri(self, version: int) -> str:
        return self.files.uri(version)

    async def publish(self, version: int, files) -> str:
        """Store the snapshot `files`'s version (from its buffers, not serialised again)."""
        self._snaps = {version: files}
        state = {s.name: t for i in range(len(files.buffers)) for s, t in files.tensors(i)}
        fp = await asyncio.to_thread(of_state, state)
        return await self.files.publish(version, files.files(), fp)

    async def restore(self, version: int, files: Callable[[], Files]) -> None:
        await self.files.restore(version, files)

    def fingerprint(self, version: int) -> str:
        return self.files.fingerprint(version)

    async def send(self, version: int, commit: Awaitable[T]) -> T:
        """The broadcast (joining the group at the first) and the commit run together; both
        finish before a failure of either is raised, so no broadcast outlives the step."""
        snap = self._snaps.pop(version)
        sent, resp = await asyncio.gather(
            asyncio.to_thread(self.broadcaster.send, version, snap),
            commit,
            return_exceptions=True,
        )
        for result in (sent, resp):
            if isinstance(result, BaseException):
                raise result
        return resp

    async def close(self) -> None:
        await asyncio.to_thread(self.broadcaster.close)


def transport_of(trainer: TrainerSpec, log) -> tuple[str, bool]:
    """(`trainer.weight_sync`, whether the files go through NATS): the spec field, with the
    deprecated `ASYNCRL_WEIGHTS_TRANSPORT=nats` mapped onto it (logged)."""
    if settings().weights_transport != "nats" or trainer.weight_sync == "nats":
        return trainer.weight_sync, trainer.weight_sync == "nats"
    log.warning(
        "deprecated_setting",
        setting="ASYNCRL_WEIGHTS_TRANSPORT=nats",
        use="trainer.weight_sync: nats in the experiment spec",
        weight_sync=trainer.weight_sync,
        effect="versions also go through the NATS object store",
    )
    return ("nats" if trainer.weight_sync == "disk" else trainer.weight_sync), True


def sender_for(
    trainer: TrainerSpec, store: Store, js, observe: Observe, log, update_timeout_s: float = 30.0
) -> WeightSender:
    """The sender `trainer.weight_sync` names; nothing is joined or uploaded yet.
    `update_timeout_s`: the rollouts' UpdateWeights deadline (a third of it bounds how long a
    broadcast waits for them)."""
    if trainer.weight_sync == "auto":
        raise ValueError(
            "trainer.weight_sync auto is chosen at submit (asyncrl.spec.spec_from_json)"
        )
    name, via_nats = transport_of(trainer, log)
    if name == "broadcast":
        from services.trainer.broadcast import BroadcastSender

        return BroadcastSender(DiskSender(store), trainer, log, update_timeout_s / 3)
    files = NatsSender(store, js, observe, log) if via_nats else DiskSender(store)
    if name == "nccl":
        return NcclSender(files, WeightBroadcaster.from_spec(trainer))
    return files
