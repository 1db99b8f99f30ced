"""`trainer.weight_sync: broadcast`: a version streamed from the trainer's parameters to the
torch engines over one process group, in buckets (`asyncrl.buckets`).

At the end of `train_step` (the trainer's only stall) `BroadcastSender.snapshot` copies the
parameters, in HF names and the published dtype, into flat bucket buffers: that copy is the
version's snapshot, which no later step changes (two sets of buffers alternate: one version is
packed while the previous one is in flight). Beside the next step, `publish` checksums each
bucket (xxh3) into the version's fingerprint and starts writing the weight store's copy from
the same buffers (the durable copy: resume, joins, eval; written in the background, no
serialisation), and `send` broadcasts the buckets while CommitWeights runs.

The group (the trainer rank 0, the experiment's ready rollouts ranks 1..n) meets on a TCPStore
the trainer hosts at `trainer.nccl_master`. Per version v, under the experiment's prefix:
  1. each rollout the scheduler sends UpdateWeights(v) (with its rank r and the number n of
     rollouts it goes to) sets `v<v>/hello/<r>` to the group it holds ("" none);
  2. the trainer waits for the n hellos, keeps its group when every one holds it and n is
     unchanged, else names a new one (a rollout joined, left or restarted), and sets
     `v<v>/plan`: the group, the bucket plan, the checksums and the fingerprint;
  3. everyone joins the new group if there is one; the trainer broadcasts every bucket, each
     rollout checksums what it received (services/rollout/broadcast_receiver.py).
When the hellos do not all come (a rollout died, the fleet skipped v) the plan says `skipped`,
and the rollouts load v from the weight store instead; a broadcast that fails midway is logged
and the group dropped (the next version builds one): rollouts load from the store then, and a
rollout that cannot is fenced by the scheduler and rejoins through the store. The trainer
never fails a step for a broadcast.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

from asyncrl import buckets
from asyncrl.collective import collective_backend, open_store, own_group
from asyncrl.fingerprint import _TORCH_DTYPES
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

    def views(self, i: int) -> list[torch.Tensor]:
        """Bucket i's tensors, as views of its buffer (no copy)."""
        return [
            self.buffers[i][s.offset : s.offset + s.nbytes].view(_dtype(s.dtype)).view(s.shape)
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


def new_buffers(p: buckets.Plan, device: torch.device) -> list[torch.Tensor]:
    import torch

    return [torch.zeros(n, dtype=torch.uint8, device=device) for n in p.sizes]


class BroadcastSender(WeightSender):
    """`broadcast`: the trainer's side (module docstring). The store copy and its URI, the
    fingerprint of a restored version and resume are the weight store's (`files`)."""

    name = "broadcast"

    def __init__(self, files: DiskSender, trainer: TrainerSpec, log, hello_timeout_s: float):
        host, port = trainer.nccl_master.rsplit(":", 1)
        self.files, self.log = files, log
        self.experiment_id = files.store.experiment_id
        self.host, self.port = host, int(port)
        self.bucket_bytes = trainer.broadcast_bucket_mb << 20
        self.hello_timeout_s = hello_timeout_s
        self.group_timeout_s = 3 * hello_timeout_s
        """How long a rank waits on the others in a collective (a dead one: then it fails)."""
        self.backend = collective_backend()
        self.tcp = None  # the TCPStore, hosted from the first snapshot on
        self.group, self.group_name, self.world = None, "", 0
        self._pool: dict[int, list[torch.Tensor]] = {}  # two sets, alternating
        self._packed = 0
        self._snaps: dict[int, Snapshot] = {}
        self._writes: dict[int, asyncio.Task] = {}
        self.last: dict[str, float] = {}
        """The last version's figures: bytes, pack_s, seal_s, hello_s, group_s, send_s."""

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

    async def restore(self, version: int, files) -> None:
        await self.files.restore(version, files)

    # ---- the snapshot: at train end, the trainer's stall ---------------------------------

    def snapshot(self, backend) -> Snapshot:
        """The trained weights packed into this version's buffers (in the step's thread)."""
        if self.tcp is None:  # hosted before any rollout asks for it
            self.tcp = open_store(self.host, self.port, master=True)
        t0 = time.perf_counter()
        state, config = backend.hf_state()
        p = buckets.plan_of_state(state, self.bucket_bytes)
        self._packed += 1
        slot = self._packed % 2  # the other set may still be in flight (sent, written)
        buffers = self._pool.get(slot)
        if buffers is None or [b.numel() for b in buffers] != list(p.sizes):
            buffers = self._pool[slot] = new_buffers(p, self.device)
        snap = Snapshot(p, pack(state, p, buffers), config)
        if self.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self.device).synchronize()
        self.last = {"bytes": p.nbytes, "pack_s": time.perf_counter() - t0}
        return snap

    async def publish(self, version: int, files) -> str:
        """Fingerprint `files` (a Snapshot) and start writing it to the store beside the send."""
        snap: Snapshot = files
        t0 = time.perf_counter()
        await asyncio.to_thread(snap.seal)
        self.last["seal_s"] = time.perf_counter() - t0
        self._snaps = {version: snap}
        store = self.files.store
        self._writes[version] = asyncio.create_task(
            asyncio.to_thread(store.write, version, snap.files(), snap.fingerprint)
        )
        return self.uri(version)

    async def send(self, version: int, commit: Awaitable[T]) -> T:
        """Broadcast beside the commit; returns once both are done and the store copy is
        written (a failed write or commit is raised; a failed broadcast is logged)."""
        snap = self._snaps[version]
        _, resp = await asyncio.gather(
            asyncio.to_thread(self._broadcast, version, snap), commit, return_exceptions=True
        )
        write = self._writes.pop(version)
        await write
        if isinstance(resp, BaseException):
            raise resp
        return resp

    async def close(self) -> None:
        for task in self._writes.values():
            task.cancel()
        await asyncio.to_thread(self._drop_group)
        self.tcp = None

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
        held = self._hellos(version)
        t1 = time.perf_counter()
        key = store_key(self.experiment_id, version, "plan")
        if held is None:
            self.tcp.set(key, json.dumps({"skipped": True}))
            self.log.warning("broadcast_skipped", version=version, reason="not every hello came")
            return
        fresh = self.group is None or self.world != len(held) + 1
        fresh = fresh or any(g != self.group_name for g in held)
        if fresh:
            self._drop_group()
            self.group_name = f"{self.experiment_id}/g{version}-{uuid.uuid4().hex[:8]}"
        plan = {
            "group": self.group_name,
            "world": len(held) + 1,
            "plan": snap.plan.to_json(),
            "checksums": snap.checksums,
            "fingerprint": snap.fingerprint,
        }
        self.tcp.set(key, json.dumps(plan))
        if fresh:
            self.group = own_group(
                self.tcp, self.backend, 0, len(held) + 1, self.group_name, self.group_timeout_s
            )
            self.world = len(held) + 1
        t2 = time.perf_counter()
        for buf in snap.buffers:
            self.group.broadcast(buf)
        t3 = time.perf_counter()
        self.last.update(hello_s=t1 - t0, group_s=t2 - t1, send_s=t3 - t2)
        self.log.info(
            "broadcast_sent",
            version=version,
            rollouts=len(held),
            new_group=fresh,
            buckets=len(snap.buffers),
            **{k: round(v, 4) for k, v in self.last.items()},
        )

    def _hellos(self, version: int) -> list[str] | None:
        """The groups the version's n rollouts hold (by rank), or None if not all said hello
        within `hello_timeout_s`."""
        timeout = timedelta(seconds=self.hello_timeout_s)
        first = store_key(self.experiment_id, version, "hello/1")
        try:
            self.tcp.wait([first], timeout)
            n = json.loads(self.tcp.get(first))["rollouts"]
            keys = [store_key(self.experiment_id, version, f"hello/{r}") for r in range(1, n + 1)]
            self.tcp.wait(keys, timeout)
        except RuntimeError:  # the store's timeout (DistStoreError)
            return None
        return [json.loads(self.tcp.get(k))["group"] for k in keys]

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.group_name, self.world = None, "", 0
