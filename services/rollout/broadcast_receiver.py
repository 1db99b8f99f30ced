"""The rollout's side of `trainer.weight_sync: broadcast` (the trainer's, and the protocol:
services/trainer/broadcast.py).

On UpdateWeights(v) with a rank r of n, `BroadcastReceiver.receive` says hello (the group it
holds), reads the version's plan from the trainer's store, joins a new group when the plan
names one, and receives every bucket into a staging buffer (kept between versions: the live
weights stay untouched while it streams and generation goes on). Each bucket's xxh3 checksum
is computed as it arrives; the version's fingerprint from them must equal the trainer's, or
nothing is applied: `Mismatch` names the buckets that differ. The engine then copies the staged
tensors into its model between two decode steps (`TorchEngine.apply_state`).

The staging buffers keep the version after it is applied, so the hello also says which one
they hold (`held`: its fingerprint, set once a version passed its checks and cleared before
the buffers change). When every rollout holds the previous version, the trainer may send a
delta version: per bucket the words that changed, written into the staging copy
(`buckets.apply_delta`) and then checked against the full version's checksums like a full one.

`Unavailable` (no plan in time, a plan that says `skipped`, a broken group): the caller loads
the version from the weight store instead.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from asyncrl import buckets
from asyncrl.collective import collective_backend, device_id, open_store, own_group
from asyncrl.logging import get_logger

log = get_logger(component="broadcast_receiver")


class Unavailable(Exception):
    """The version did not come by broadcast: load it from the weight store."""


class Mismatch(Exception):
    """What arrived is not what the trainer sent (checksums or fingerprint differ)."""


@dataclass
class Received:
    state: dict[str, torch.Tensor]
    """Name -> a view of the staging buffers (valid until the next `receive`)."""
    fingerprint: str
    nbytes: int
    seconds: float
    moved: int = 0
    """The bytes that arrived (a delta version's are fewer than `nbytes`)."""
    delta: bool = False


def _key(experiment_id: str, version: int, what: str) -> str:
    return f"{experiment_id}/v{version}/{what}"  # services/trainer/broadcast.py: store_key


class BroadcastReceiver:
    """One rollout's membership in an experiment's weight group, and its staging buffers."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else collective_backend()
        self.master = ""
        self.tcp = None
        self.group, self.group_name = None, ""
        self._staging: tuple[buckets.Plan, list[torch.Tensor]] | None = None
        self.held = ""
        """The fingerprint of the version the staging buffers hold ("" none or unknown)."""
        self.corrupt = None
        """Tests only: called with the staged buffers before they are checked."""

    def receive(
        self, experiment_id: str, master: str, version: int, rank: int, n: int, timeout_s: float
    ) -> Received:
        """Version `version` as rank `rank` of `n` rollouts (blocking: a worker thread)."""
        t0 = time.perf_counter()
        try:
            info = self._plan(experiment_id, master, version, rank, n, timeout_s)
            self.held = ""  # the staging buffers change from here on
            p = buckets.Plan.from_json(info["plan"])
            if info["group"] != self.group_name:
                self.close()
                backend = info.get("backend", self.backend)  # gloo where ranks share a GPU
                self.group = own_group(
                    self.tcp, backend, rank, info["world"], info["group"], timeout_s
                )
                self.group_name = info["group"]
            staged = self._buffers(p)
            sums, moved = self._stream(p, staged, info.get("delta"))
        except (RuntimeError, ValueError) as exc:  # store or group gone, timed out
            self.close()
            self.tcp = None  # reconnected next time (the trainer may have restarted)
            raise Unavailable(f"{type(exc).__name__}: {exc}") from exc
        self._check(version, info, p, sums)
        self.held = info["fingerprint"]
        state = {s.name: _view(staged[s.bucket], s) for s in p.slots}
        seconds = time.perf_counter() - t0
        delta = info.get("delta") is not None
        return Received(state, info["fingerprint"], p.nbytes, seconds, moved, delta)

    def _plan(self, experiment_id, master, version, rank, n, timeout_s) -> dict:
        """Hello (the group held), then the trainer's plan for the version."""
        if self.tcp is None or master != self.master:
            host, port = master.rsplit(":", 1)
            self.close()
            self.tcp, self.master = open_store(host, int(port), False, timeout_s), master
        hello = {"group": self.group_name, "rollouts": n, "holds": self.held}
        hello = json.dumps(hello | {"device": device_id(self.device)})
        self.tcp.set(_key(experiment_id, version, f"hello/{rank}"), hello)
        key = _key(experiment_id, version, "plan")
        self.tcp.wait([key], timedelta(seconds=timeout_s))
        info = json.loads(self.tcp.get(key))
        if info.get("skipped"):
            raise Unavailable(f"the trainer did not broadcast v{version}")
        return info

    def _buffers(self, p: buckets.Plan) -> list[torch.Tensor]:
        if self._staging is None or self._staging[0] != p:
            bufs = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in p.sizes]
            self._staging = (p, bufs)
        return self._staging[1]

    def _stream(self, p: buckets.Plan, staged: list[torch.Tensor], delta) -> tuple[list, int]:
        """Receive every bucket, whole or (`delta`: per bucket its changed words, None for a
        whole one) as a delta into its staging copy; the checksums, each computed as its
        bucket arrives, and the bytes that arrived."""
        sums, moved = [], 0
        for i, buf in enumerate(staged):
            moved += self._bucket(buf, None if delta is None else delta[i])
            if self.corrupt is not None:
                self.corrupt(i, buf)
            sums.append(buckets.checksum(buckets.raw(_view(buf, s)) for s in p.bucket(i)))
        return sums, moved

    def _bucket(self, buf: torch.Tensor, words: int | None) -> int:
        """One bucket into `buf`: whole, or the delta of `words` changed words; its bytes."""
        if words is None:
            self.group.broadcast(buf)
            return buf.numel()
        if words:  # an unchanged bucket moves nothing
            delta = torch.empty(2 * words, dtype=torch.int32, device=self.device)
            self.group.broadcast(delta)
            buckets.apply_delta(buf, delta)
        return buckets.delta_nbytes(words)

    def _check(self, version: int, info: dict, p: buckets.Plan, sums: list[int]) -> None:
        bad = [i for i, (a, b) in enumerate(zip(sums, info["checksums"], strict=True)) if a != b]
        fp = buckets.fingerprint(p, sums)
        if bad or fp != info["fingerprint"]:
            log.warning("broadcast_mismatch", version=version, buckets=bad, fingerprint=fp)
            raise Mismatch(
                f"v{version}: bucket(s) {bad} arrived with other checksums than the trainer's "
                f"(fingerprint {fp}, the trainer's {info['fingerprint']})"
            )

    def close(self) -> None:
        """Leave the group (the store connection stays)."""
        if self.group is not None:
            self.group.close()
        self.group, self.group_name = None, ""


def _view(buf: torch.Tensor, s: buckets.Slot) -> torch.Tensor:
    return buf[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
