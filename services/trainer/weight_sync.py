"""The trainer's side of the collective weight update into SGLang (`trainer.weight_sync: nccl`).

Protocol (SGLang's `update_weights_from_distributed`, as AReaL and slime use it), the trainer
being rank 0 of one process group with the GPUs of every SGLang server:
  1. once: each engine POSTs `/init_weights_update_group` (the trainer's `nccl_master`, its
     `rank_offset`, the world size, the group name, the backend) at its first update, while the
     trainer joins the same group (`WeightBroadcaster.connect`); both block until the
     rendezvous completes.
  2. per version: each engine POSTs `/update_weights_from_distributed` bucket by bucket (HF
     names, dtypes and full shapes, read from the safetensors headers of the version
     directory); each call returns once SGLang has received that bucket. Concurrently the
     trainer broadcasts every tensor of the same directory, one broadcast each, in name order.

Both sides read the version directory the trainer publishes to the weight store and order its
tensors by name, so they agree on names, dtypes and order, and the trainer needs no bucket plan
(buckets only group the engine's HTTP calls; a tied `lm_head.weight` is not in the files, so
it is not sent). The engine's half is `SGLangEngine` with services/rollout/sglang_sync.py.

The group's backend is NCCL when the trainer has a CUDA device, else gloo (CPU-only trainers,
the tests); the engines must be configured with the same (`nccl_backend`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.collective import TIMEOUT_S, collective_backend, init_custom_group
from asyncrl.weights import load_state_dict_files

if TYPE_CHECKING:
    import torch

    from asyncrl.spec import TrainerSpec

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
    """Rank 0 of the weight-update group: `send_version(dir)` per committed version (it joins
    the group on first use), `close()` at the end. Blocking calls: run them in a thread."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = GROUP_NAME,
        backend: str | None = None,
        timeout_s: float = TIMEOUT_S,
    ):
        self.master_address = master_address
        self.master_port = master_port
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend or collective_backend()
        self.timeout_s = timeout_s
        self.group = None
        self._lock = threading.Lock()  # close() waits for a send in flight

    @classmethod
    def from_spec(cls, trainer: TrainerSpec) -> WeightBroadcaster | None:
        """The broadcaster `trainer.weight_sync: nccl` asks for; None for `disk`."""
        if trainer.weight_sync != "nccl":
            return None
        host, port = trainer.nccl_master.rsplit(":", 1)
        return cls(host, int(port), trainer.nccl_world_size)

    @property
    def device(self) -> torch.device:
        """Where a tensor must be to be sent: this rank's GPU under NCCL, else the CPU."""
        import torch

        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def connect(self) -> None:
        """Join the group as rank 0; blocks until every engine rank has joined."""
        self.group = init_custom_group(
            self.backend,
            self.master_address,
            self.master_port,
            0,
            self.world_size,
            self.group_name,
            self.timeout_s,
        )

    def broadcast(self, state: Mapping[str, torch.Tensor]) -> None:
        """Send every tensor of `state` (HF names, full shapes) in name order, in its own dtype,
        which must be the dtype of the checkpoint the engines read their metadata from.
        Returns once sent (NCCL's broadcasts are waited for, as gloo's are)."""
        import torch
        import torch.distributed as dist

        assert self.group is not None, "connect() first"
        device = self.device
        for name in sorted(state):
            dist.broadcast(state[name].to(device).contiguous(), src=0, group=self.group)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def send_version(self, model_dir: str | Path) -> None:
        """Broadcast a published version directory: exactly the tensors whose headers the
        engines read. Joins the group first if not yet joined."""
        with self._lock:
            if self.group is None:
                self.connect()
            self.broadcast(load_state_dict_files(model_dir))

    def close(self) -> None:
        import torch.distributed as dist

        with self._lock:
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None
