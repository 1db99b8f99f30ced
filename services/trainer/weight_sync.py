"""The trainer's side of the collective weight update into SGLang (`trainer.weight_sync: nccl`).

Protocol (SGLang's `update_weights_from_distributed` with `load_format: "flattened_bucket"`),
the trainer being rank 0 of one process group with the GPUs of every SGLang server:
  0. at train end `WeightBroadcaster.snapshot` copies the trainer's parameters (HF names, the
     published dtype: `TrainerBackend.hf_state`) into flat uint8 bucket buffers laid out as
     `asyncrl.buckets.plan(..., packed=True)`: tensors back to back, no padding, each at a
     multiple of its dtype's itemsize (what SGLang's `FlattenedTensorBucket` reconstructs; a
     tensor that would land misaligned starts a new bucket). No later step changes them. The
     weight store's copy is written from the same buffers (transport.NcclSender).
  1. the trainer hosts a TCPStore at `trainer.nccl_master`; once, each engine POSTs
     `/init_weights_update_group` there (its `rank_offset`, the world size, the group name, the
     backend: SGLang's tcp:// rendezvous joins that store) while the trainer joins the same
     group on it (`group_on_store`); both block until every rank is in.
  2. per version v the trainer sets the plan (`Plan.to_json`: names, dtypes, shapes, bucket
     size) at `<group>/v<v>/plan` in its store, and broadcasts each bucket buffer, ONE
     broadcast per bucket. Each engine reads the plan from the store
     (services/rollout/sglang_sync.py: the engine never reads the version directory on this
     path) and POSTs `/update_weights_from_distributed` once per bucket with that bucket's
     names, dtypes and shapes; SGLang allocates the bucket, receives the one broadcast and
     loads the tensors. The previous version's plan key is deleted.

The store copy is only for restarts, resume and evaluation. The group's backend is NCCL when
the trainer has a CUDA device, else gloo (CPU-only trainers, the tests); the engines must be
configured with the same (`nccl_backend`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from asyncrl import buckets
from asyncrl.collective import (
    TIMEOUT_S,
    collective_backend,
    group_on_store,
    init_custom_group,
    open_store,
    plan_key,
)

if TYPE_CHECKING:
    import torch

    from asyncrl.spec import TrainerSpec
    from services.trainer.broadcast import Snapshot

GROUP_NAME = "asyncrl-weights"
"""The weight-update group's name (the SGLang engine's default `nccl_group`)."""
__all__ = [
    "GROUP_NAME",
    "TIMEOUT_S",
    "WeightBroadcaster",
    "collective_backend",
    "init_custom_group",
]


class WeightBroadcaster:
    """Rank 0 of the weight-update group: `snapshot(state, config)` at train end, then
    `send(version, snapshot)` per committed version (it hosts the store and joins the group on
    first use), `close()` at the end. Blocking calls: run them in a thread."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = GROUP_NAME,
        backend: str | None = None,
        timeout_s: float = TIMEOUT_S,
        bucket_bytes: int = 64 << 20,
    ):
        self.master_address = master_address
        self.master_port = master_port
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend or collective_backend()
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.tcp = None  # the TCPStore the group meets on, hosted from the first use
        self.group = None
        self.broadcasts = 0
        """Broadcasts made so far (one per bucket)."""
        self._sent: int | None = None  # the last version whose plan is in the store
        self._sets = buckets.BufferSets()
        self._lock = threading.Lock()  # close() waits for a send in flight

    @classmethod
    def from_spec(cls, trainer: TrainerSpec) -> WeightBroadcaster | None:
        """The broadcaster `trainer.weight_sync: nccl` asks for; None for the others."""
        if trainer.weight_sync != "nccl":
            return None
        host, port = trainer.nccl_master.rsplit(":", 1)
        bucket_bytes = trainer.broadcast_bucket_mb << 20
        return cls(host, int(port), trainer.nccl_world_size, bucket_bytes=bucket_bytes)

    @property
    def device(self) -> torch.device:
        """Where a tensor must be to be sent: this rank's GPU under NCCL, else the CPU."""
        import torch

        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def host(self) -> None:
        """Host the group's store (before any engine's rendezvous needs it)."""
        if self.tcp is None:
            self.tcp = open_store(self.master_address, self.master_port, True, self.timeout_s)

    def snapshot(self, state: Mapping[str, torch.Tensor], config: bytes = b"{}") -> Snapshot:
        """`state` (HF names, the dtype to publish) copied into packed bucket buffers: two sets
        alternate, so a version may be in flight while the next is packed (not two)."""
        import torch

        from services.trainer.broadcast import Snapshot, pack  # it imports us

        self.host()
        p = buckets.plan_of_state(state, self.bucket_bytes, packed=True)
        snap = Snapshot(p, pack(state, p, self._sets.next(p, self.device)), config)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return snap

    def connect(self) -> None:
        """Join the group as rank 0; blocks until every engine rank has joined."""
        self.host()
        self.group = group_on_store(
            self.tcp, self.backend, 0, self.world_size, self.group_name, self.timeout_s
        )

    def send(self, version: int, snap: Snapshot) -> None:
        """Publish the plan of `snap` for `version` and broadcast its buckets, one broadcast
        each; returns once sent. Joins the group first if not yet joined."""
        import torch
        import torch.distributed as dist

        with self._lock:
            self.host()
            self.tcp.set(plan_key(self.group_name, version), snap.plan.to_json())
            if self._sent is not None and self._sent != version:
                self.tcp.delete_key(plan_key(self.group_name, self._sent))
            self._sent = version
            if self.group is None:
                self.connect()
            for buf in snap.buffers:
                dist.broadcast(buf, src=0, group=self.group)
                self.broadcasts += 1
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

    def send_state(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """`snapshot` then `send`: a version straight from tensors (tools, tests)."""
        self.send(version, self.snapshot(state))

    def close(self) -> None:
        import torch.distributed as dist

        with self._lock:
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None
            self.tcp = None
