"""`trainer.weight_sync: broadcast`: a version streamed from the trainer's parameters to the
torch engines, in buckets (`asyncrl.buckets`): through shared memory to the engines of the
trainer's host (`asyncrl.shm`), over one process group otherwise.

At the end of `train_step` (the trainer's only stall) `BroadcastSender.snapshot` copies the
parameters, in HF names and the published dtype, into flat bucket buffers: that copy is the
version's snapshot, which no later step changes (two sets of buffers alternate: one version is
packed while the previous one is in flight; on a CPU trainer they are files in /dev/shm).
Beside the next step, `publish` checksums each bucket (xxh3) into the version's fingerprint,
and `send` hands the buckets over while CommitWeights runs, then writes the weight store's
copy from the same buffers (the durable copy: resume, joins, eval; no serialisation; after the
hand-over, which it would slow on a few cores: a rollout that loads from the store waits for
it).

The group (the trainer rank 0, the experiment's ready rollouts ranks 1..n) meets on a TCPStore
the trainer hosts at `trainer.nccl_master`, or, unset, on its advertised host
(ASYNCRL_ADVERTISE_HOST) at a port the OS gives it: each CommitWeights carries that address
(`store_address`) and the scheduler passes it on in UpdateWeights, so two experiments on one
host never collide. Per version v, under the experiment's prefix:
  1. each rollout the scheduler sends UpdateWeights(v) (with its rank r and the number n of
     rollouts it goes to) sets `v<v>/hello/<r>` to the group it holds ("" none), the
     fingerprint its staging buffers hold and its device (`collective.device_id`);
  2. the trainer waits for the n hellos, keeps its group when every one holds it and n is
     unchanged, else names a new one (a rollout joined, left or restarted), and sets
     `v<v>/plan`: the group, its backend (NCCL only where every rank has a GPU of its own,
     else gloo: `collective.group_backend`), the bucket plan, the checksums and the fingerprint;
  3. everyone joins the new group if there is one; the trainer broadcasts every bucket, each
     rollout checksums what it received (services/rollout/broadcast_receiver.py).
When every hello says the rollout reads the trainer's /dev/shm (it found there the token the
trainer advertised under `<experiment>/shm`) the plan names the version's files instead (its
`backend` is `shm`, no group is needed): each rollout copies the buckets out, says
`v<v>/done/<r>`, and checks its copy; the trainer waits for every `done` (`shm.wait_s`) before
the set may be packed again. A version through memory goes whole.
A version may travel as a delta (`trainer.broadcast_delta`): beside the next step `publish`
also encodes each bucket against the same bucket of the previous version, still intact in the
other set of buffers (`buckets.encode_delta`: the 4-byte words that changed, indices + values;
a bucket where that is not smaller goes whole). A rollout's hello says the fingerprint of what
its staging buffers hold ("" when unknown: nothing received yet, or a version that did not pass
its checks); the trainer sends the delta only when every hello holds the previous version, the
group is unchanged and fewer than `trainer.broadcast_full_every` - 1 deltas went in a row
(`use_delta`). The plan then names that base and each bucket's changed words (`delta`); each
rollout writes them into its staging copy and checks the result against the full version's
checksums, so a wrong base is a `Mismatch` like a flipped bit, and the next version goes whole.
When the hellos do not all come (a rollout died, the fleet skipped v) the plan says `skipped`,
and the rollouts load v from the weight store instead; a broadcast that fails midway is logged
and the group dropped (the next version builds one): rollouts load from the store then, and a
rollout that cannot is fenced by the scheduler and rejoins through the store. The trainer
never fails a step for a broadcast.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

from asyncrl import buckets, shm
from asyncrl.collective import (
    collective_backend,
    device_id,
    group_backend,
    open_store,
    own_group,
)
from asyncrl.fingerprint import _TORCH_DTYPES
from asyncrl.settings import settings
from services.trainer.transport import DiskSender, WeightSender

if TYPE_CHECKING:
    import torch

    from asyncrl.spec import TrainerSpec

T = TypeVar("T")


def store_key(experiment_id: str, version: int, what: str) -> str:
    """A key of the group's store: `<experiment>/v<version>/<what>` (hello/<rank>, plan)."""
    return f"{experiment_id}/v{version}/{what}"


@dataclass
class Snapshot:
    """One version packed into bucket buffers (uint8, on the group's device)."""

    plan: buckets.Plan
    buffers: list[torch.Tensor]
    config: bytes
    """config.json of the version."""
    checksums: list[int] = field(default_factory=list)
    fingerprint: str = ""
    base: Snapshot | None = None
    """The previous version while its buffers are intact and not yet encoded against."""
    base_fp: str = ""
    """The fingerprint of the version `deltas` apply to ("" none encoded)."""
    deltas: list[torch.Tensor | None] = field(default_factory=list)
    """Per bucket, its `buckets.encode_delta` delta against the base, or None (send whole)."""
    changed: list[int] = field(default_factory=list)
    """Per bucket, how many of its words differ from the base's."""

    def views(self, i: int) -> list[torch.Tensor]:
        """Bucket i's tensors, as views of its buffer (no copy)."""
        return [t for _, t in self.tensors(i)]

    def tensors(self, i: int) -> list[tuple[buckets.Slot, torch.Tensor]]:
        """Bucket i's slots and their tensors, as views of its buffer (no copy)."""
        return [
            (s, self.buffers[i][s.offset : s.offset + s.nbytes].view(_dtype(s.dtype)).view(s.shape))
            for s in self.plan.bucket(i)
        ]

    def seal(self) -> None:
        """Checksum every bucket and fingerprint the version (off the critical path)."""
        self.checksums = [
            buckets.checksum(buckets.raw(t) for t in self.views(i))
            for i in range(len(self.buffers))
        ]
        self.fingerprint = buckets.fingerprint(self.plan, self.checksums)

    def files(self) -> dict[str, bytes | list]:
        """The version's files for the weight store: model.safetensors as its header and then
        the tensors' bytes in place (not copied into one buffer), and config.json."""
        header, parts, at = {"__metadata__": {"format": "pt"}}, [], 0
        for i in range(len(self.buffers)):
            for s, t in zip(self.plan.bucket(i), self.views(i), strict=True):
                header[s.name] = {
                    "dtype": _TORCH_DTYPES[s.dtype],
                    "shape": list(s.shape),
                    "data_offsets": [at, at + s.nbytes],
                }
                parts.append(buckets.raw(t))
                at += s.nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        prefix = len(head).to_bytes(8, "little") + head
        return {"model.safetensors": [prefix, *parts], "config.json": self.config}


def use_delta(holds: list[str], base_fp: str, fresh: bool, in_row: int, full_every: int) -> bool:
    """Whether a version goes as its delta: encoded against base `base_fp` ("" none), every
    rollout holds that base (`holds`, their hellos), the group is not new, and `in_row` deltas
    (since the last full version) leave room for one more of `full_every` - 1."""
    if fresh or not base_fp or in_row + 1 >= full_every:
        return False
    return all(h == base_fp for h in holds)


def sent_bytes(snap: Snapshot, delta: bool) -> int:
    """What the buckets of `snap` move over the group, as a delta version or a full one."""
    if not delta:
        return sum(snap.plan.sizes)
    return sum(
        size if d is None else buckets.delta_nbytes(k)
        for size, d, k in zip(snap.plan.sizes, snap.deltas, snap.changed, strict=True)
    )


def _dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def pack(
    state: Mapping[str, torch.Tensor], p: buckets.Plan, buffers: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Copy `state` into `buffers` (allocated for plan `p` when None fit) as `p` lays it out."""
    for s in p.slots:
        dst = buffers[s.bucket][s.offset : s.offset + s.nbytes].view(_dtype(s.dtype))
        dst.view(s.shape).copy_(state[s.name])
    return buffers


class BroadcastSender(WeightSender):
    """`broadcast`: the trainer's side (module docstring). The store copy and its URI, the
    fingerprint of a restored version and resume are the weight store's (`files`)."""

    name = "broadcast"

    def __init__(self, files: DiskSender, trainer: TrainerSpec, log, hello_timeout_s: float):
        host, port = (trainer.nccl_master or f"{settings().advertise_host}:0").rsplit(":", 1)
        self.files, self.log = files, log
        self.experiment_id = files.store.experiment_id
        self.host, self.port = host, int(port)  # port 0: the OS picks one when it is hosted
        self.bucket_bytes = trainer.broadcast_bucket_mb << 20
        self.hello_timeout_s = hello_timeout_s
        self.group_timeout_s = 3 * hello_timeout_s
        """How long a rank waits on the others in a collective (a dead one: then it fails)."""
        self.backend = collective_backend()
        self.tcp = None  # the TCPStore, hosted from the first snapshot on
        self.group, self.group_name, self.world = None, "", 0
        self.group_backend = ""
        """The group's backend (`group_backend`: gloo where ranks share a GPU)."""
        self.region = None
        if self.backend == "gloo" and settings().broadcast_shm and shm.available():
            shm.sweep()  # the files of trainers killed before they removed them
            self.region = shm.Region()
        hooks = (self.region.alloc, self.region.free) if self.region else (None, None)
        self._sets = buckets.BufferSets(*hooks)
        self._local, self._full_logged = False, False
        """The last version went by shared memory (then the next one is not encoded as a
        delta: what goes through memory goes whole)."""
        self.delta, self.full_every = trainer.broadcast_delta, trainer.broadcast_full_every
        self._in_row = 0  # delta versions sent since the last full one
        self._last: Snapshot | None = None  # the newest snapshot: the next one's base
        self._base_lock = threading.Lock()  # a base is encoded against or overwritten
        self._snaps: dict[int, Snapshot] = {}
        self._moved: dict[int, tuple[int, int]] = {}  # the last version sent: (sent, full)
        self.last: dict[str, float] = {}
        """The last version's figures: bytes, pack_s, seal_s, delta_s, hello_s, group_s,
        send_s, the bytes the group moved (sent_bytes; full_bytes as a full version) and, when
        it was encoded as a delta, the fraction of its words that changed (changed)."""

    @property
    def device(self) -> torch.device:
        import torch

        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def uri(self, version: int) -> str:
        return self.files.uri(version)

    def fingerprint(self, version: int) -> str:
        snap = self._snaps.get(version)
        return snap.fingerprint if snap else self.files.fingerprint(version)

    def moved(self, version: int) -> tuple[int, int]:
        return self._moved.get(version, (0, 0))

    @property
    def store_address(self) -> str:
        """host:port of the group's store once hosted (the first `snapshot`), else ""."""
        return f"{self.host}:{self.tcp.port}" if self.tcp is not None else ""

    async def restore(self, version: int, files) -> None:
        await self.files.restore(version, files)

    # ---- the snapshot: at train end, the trainer's stall ---------------------------------

    def snapshot(self, backend) -> Snapshot:
        """The trained weights packed into this version's buffers (in the step's thread)."""
        if self.tcp is None:  # hosted before any rollout asks for it
            self.tcp = open_store(self.host, self.port, master=True)
            self.log.info("broadcast_store_hosted", address=self.store_address)
            if self.region is not None:
                key = f"{self.experiment_id}/shm"
                self.tcp.set(key, json.dumps(self.region.advert()))
        t0 = time.perf_counter()
        state, config = backend.hf_state()
        p = buckets.plan_of_state(state, self.bucket_bytes)
        last = self._last
        with self._base_lock:  # the set about to be packed is the newest snapshot's base
            if last is not None:
                last.base = None
        buffers = self._sets.next(p, self.device)
        snap = Snapshot(p, pack(state, p, buffers), config)
        if last is not None and last.plan == p and last.buffers is not buffers:
            snap.base = last
        self._last = snap
        if self.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self.device).synchronize()
        self.last = {"bytes": p.nbytes, "pack_s": time.perf_counter() - t0}
        return snap

    async def publish(self, version: int, files) -> str:
        """Fingerprint `files` (a Snapshot); `send` sends it, then writes it to the store."""
        snap: Snapshot = files
        t0 = time.perf_counter()
        await asyncio.to_thread(snap.seal)
        t1 = time.perf_counter()
        await asyncio.to_thread(self._encode, snap)
        self.last.update(seal_s=t1 - t0, delta_s=time.perf_counter() - t1)
        self._snaps = {version: snap}
        return self.uri(version)

    async def send(self, version: int, commit: Awaitable[T]) -> T:
        """Broadcast beside the commit, then write the store copy (after the broadcast: on a
        few cores the write would slow the engines' copies; a rollout that loads the version
        from the store waits for it); returns once all are done (a failed write or commit is
        raised; a failed broadcast is logged)."""
        snap = self._snaps[version]

        async def then_store() -> None:
            await asyncio.to_thread(self._broadcast, version, snap)
            store = self.files.store
            await asyncio.to_thread(store.write, version, snap.files(), snap.fingerprint)

        written, resp = await asyncio.gather(then_store(), commit, return_exceptions=True)
        for outcome in (written, resp):
            if isinstance(outcome, BaseException):
                raise outcome
        return resp

    async def close(self) -> None:
        await asyncio.to_thread(self._drop_group)
        self.tcp = None
        if self.region is not None:
            self.region.close()

    def _encode(self, snap: Snapshot) -> None:
        """Each bucket's delta against the previous version, while its buffers are intact (a
        worker thread; the next `snapshot` waits for it before packing over them)."""
        with self._base_lock:
            base, snap.base = snap.base, None
            due = self._in_row + 1 >= self.full_every  # this version goes whole anyway
            if base is None or not base.fingerprint or not self.delta or due or self._local:
                return
            pairs = [
                buckets.encode_delta(new, old)
                for new, old in zip(snap.buffers, base.buffers, strict=True)
            ]
            snap.changed = [k for k, _ in pairs]
            snap.deltas = [d for _, d in pairs]
            if any(d is not None for d in snap.deltas):  # else nothing to gain: goes whole
                snap.base_fp = base.fingerprint

    # ---- the broadcast (a worker thread) -------------------------------------------------

    def _broadcast(self, version: int, snap: Snapshot) -> None:
        try:
            self._stream(version, snap)
        except Exception as exc:  # noqa: BLE001 - the store copy is the way back
            self.log.warning(
                "broadcast_failed", version=version, error=f"{type(exc).__name__}: {exc}"
            )
            self._drop_group()

    def _stream(self, version: int, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        hellos = self._hellos(version)
        t1 = time.perf_counter()
        key = store_key(self.experiment_id, version, "plan")
        if hellos is None:
            self.tcp.set(key, json.dumps({"skipped": True}))
            self.log.warning("broadcast_skipped", version=version, reason="not every hello came")
            return
        world = len(hellos) + 1
        paths = self._shared(snap, hellos)
        self._local = paths is not None
        if paths is not None:
            self._hand_over(version, snap, paths, world)
            self._in_row = 0
            self._sent(version, snap, False, len(hellos), False, (t0, t1, t1, time.perf_counter()))
            return
        devices = [device_id(self.device), *(h.get("device", "") for h in hellos)]
        backend = group_backend(self.backend, devices)
        fresh = self.group is None or self.world != world or backend != self.group_backend
        fresh = fresh or any(h["group"] != self.group_name for h in hellos)
        holds = [h.get("holds", "") for h in hellos]
        delta = use_delta(holds, snap.base_fp, fresh, self._in_row, self.full_every)
        if fresh:
            self._drop_group()
            self.group_name = f"{self.experiment_id}/g{version}-{uuid.uuid4().hex[:8]}"
        self.tcp.set(key, json.dumps(self._plan(snap, world, delta) | {"backend": backend}))
        if fresh:
            self.group = own_group(
                self.tcp, backend, 0, world, self.group_name, self.group_timeout_s
            )
            self.world, self.group_backend = world, backend
        t2 = time.perf_counter()
        self._send_buckets(snap, delta)
        self._in_row = self._in_row + 1 if delta else 0
        t3 = time.perf_counter()
        self._sent(version, snap, delta, len(hellos), fresh, (t0, t1, t2, t3))

    def _shared(self, snap: Snapshot, hellos: list[dict]) -> list[str] | None:
        """The files of `snap`'s buckets when every rollout reads this host's shared memory
        and the buckets are there (`asyncrl.shm`), else None (the group)."""
        if self.region is None or not settings().broadcast_shm:
            return None
        if not all(h.get("shm") for h in hellos):
            return None
        paths = [self.region.path(b) for b in snap.buffers]
        if None in paths and not self._full_logged:  # /dev/shm had no room for a set
            self.log.warning("broadcast_shm_full", bytes=snap.plan.nbytes, then="socket")
            self._full_logged = True
        return None if None in paths else paths

    def _hand_over(self, version: int, snap: Snapshot, paths: list[str], world: int) -> None:
        """The plan names the files; each rollout copies the buckets out and says `done`
        (then this set may be packed again)."""
        plan = self._plan(snap, world, False) | {"backend": "shm", "shm": paths}
        self.tcp.set(store_key(self.experiment_id, version, "plan"), json.dumps(plan))
        self._copied(version, world, snap.plan.nbytes)

    def _copied(self, version: int, world: int, nbytes: int) -> None:
        """Wait until every rollout copied the version out, at most `shm.wait_s`. One
        that is not done by then reads a set the trainer may pack again: its checksums then
        fail and it loads the version from the store."""
        done = [store_key(self.experiment_id, version, f"done/{r}") for r in range(1, world)]
        timeout_s = shm.wait_s(nbytes)
        try:
            self.tcp.wait(done, timedelta(seconds=timeout_s))
        except RuntimeError:  # the store's timeout: a rollout died or stalls mid-copy
            self.log.warning("shm_copy_late", version=version, timeout_s=timeout_s)

    def _plan(self, snap: Snapshot, world: int, delta: bool) -> dict:
        """The version's plan for the store; a delta version's names its base and, per
        bucket, its changed words (None: the bucket goes whole)."""
        plan = {
            "group": self.group_name,
            "world": world,
            "plan": snap.plan.to_json(),
            "checksums": snap.checksums,
            "fingerprint": snap.fingerprint,
        }
        if delta:
            plan["base"] = snap.base_fp
            plan["delta"] = [
                None if d is None else k for d, k in zip(snap.deltas, snap.changed, strict=True)
            ]
        return plan

    def _send_buckets(self, snap: Snapshot, delta: bool) -> None:
        for i, buf in enumerate(snap.buffers):
            d = snap.deltas[i] if delta else None
            if d is None:
                self.group.broadcast(buf)
            elif d.numel():  # an unchanged bucket moves nothing
                self.group.broadcast(d)

    def _sent(self, version, snap: Snapshot, delta: bool, rollouts, fresh, times) -> None:
        t0, t1, t2, t3 = times
        self._moved = {version: (sent_bytes(snap, delta), sent_bytes(snap, False))}
        sent, full = self._moved[version]
        self.last.update(
            hello_s=t1 - t0, group_s=t2 - t1, send_s=t3 - t2, sent_bytes=sent, full_bytes=full
        )
        if snap.changed:  # encoded: the fraction of words that differ from the base
            words = sum(snap.plan.sizes) // buckets.WORD
            self.last["changed"] = sum(snap.changed) / max(words, 1)
        self.log.info(
            "broadcast_sent",
            version=version,
            rollouts=rollouts,
            new_group=fresh,
            buckets=len(snap.buffers),
            mode="delta" if delta else "full",
            via="shm" if self._local else self.group_backend,
            **{k: round(v, 6 if k == "changed" else 4) for k, v in self.last.items()},
        )

    def _hellos(self, version: int) -> list[dict] | None:
        """The hellos of the version's n rollouts (by rank: the group each holds, the
        fingerprint its staging holds), or None if not all came within `hello_timeout_s`."""
        timeout = timedelta(seconds=self.hello_timeout_s)
        first = store_key(self.experiment_id, version, "hello/1")
        try:
            self.tcp.wait([first], timeout)
            n = json.loads(self.tcp.get(first))["rollouts"]
            keys = [store_key(self.experiment_id, version, f"hello/{r}") for r in range(1, n + 1)]
            self.tcp.wait(keys, timeout)
        except RuntimeError:  # the store's timeout (DistStoreError)
            return None
        return [json.loads(self.tcp.get(k)) for k in keys]

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.group_name, self.world = None, "", 0
