"""The rollout's side of `trainer.weight_sync: broadcast` (the trainer's, and the protocol:
services/trainer/broadcast.py).

On UpdateWeights(v) with a rank r of n, `BroadcastReceiver.receive` says hello (the group it
holds, whether it reads the trainer's /dev/shm), reads the version's plan from the trainer's
store and receives every bucket into a staging set: copied out of the trainer's files in
/dev/shm when the plan names them (`asyncrl.shm`), else over the group the plan names (joined
when new). Each bucket's xxh3 checksum is computed over what arrived; the version's fingerprint
from them must equal the trainer's, or nothing is applied: `Mismatch` names the buckets that
differ. The engine then takes the staged tensors as its weights between two decode steps
(`TorchEngine.apply_state`: no copy). There are two staging sets (`Staging`): a version is
received into the one the engine does not serve from, so generation goes on untouched while it
streams.

The hello also says which version the newest set holds (`held`: its fingerprint, set once a
version passed its checks, cleared when anything fails or the engine loads from the store).
When every rollout holds the previous version, the trainer may send a delta version: per
bucket the words that changed, written onto a copy of the newest set (`buckets.apply_delta`)
and then checked against the full version's checksums like a full one.

`Unavailable` (no plan in time, a plan that says `skipped`, a broken group): the caller loads
the version from the weight store instead.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from asyncrl import buckets, shm
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
        self.staging = Staging(self.device)
        self.maps = shm.Maps()
        """The trainer's shared bucket files, mapped (same host: `asyncrl.shm`)."""
        self.corrupt = None
        """Tests only: called with the staged buffers before they are checked."""

    def receive(
        self, experiment_id: str, master: str, version: int, rank: int, n: int, timeout_s: float
    ) -> Received:
        """Version `version` as rank `rank` of `n` rollouts (blocking: a worker thread)."""
        t0 = time.perf_counter()
        try:
            info = self._plan(experiment_id, master, version, rank, n, timeout_s)
            p = buckets.Plan.from_json(info["plan"])
            staged = self.staging.target(p)  # not the set the engine may be serving from
            if info.get("shm"):
                sums, moved = self._copy_out(p, staged, info["shm"])
                self._done(_key(experiment_id, version, f"done/{rank}"))
            else:
                self._join(info, rank, timeout_s)
                if info.get("delta") is not None:
                    self.staging.base(info["base"])  # the newest version, under the delta
                sums, moved = self._stream(p, staged, info.get("delta"))
        except (RuntimeError, ValueError, OSError) as exc:  # store, group or files gone
            self.close()
            self.tcp = None  # reconnected next time (the trainer may have restarted)
            self.staging.forget()  # the engine loads the version from the store instead
            raise Unavailable(f"{type(exc).__name__}: {exc}") from exc
        try:
            self._check(version, info, p, sums)
        except Mismatch:
            self.staging.forget()
            raise
        self.staging.took(info["fingerprint"])
        state = {s.name: _view(staged[s.bucket], s) for s in p.slots}
        seconds = time.perf_counter() - t0
        delta = info.get("delta") is not None
        return Received(state, info["fingerprint"], p.nbytes, seconds, moved, delta)

    def _join(self, info: dict, rank: int, timeout_s: float) -> None:
        """Join the group the plan names, unless already in it."""
        if info["group"] != self.group_name:
            self.close()
            backend = info.get("backend", self.backend)  # gloo where ranks share a GPU
            self.group = own_group(self.tcp, backend, rank, info["world"], info["group"], timeout_s)
            self.group_name = info["group"]

    def _plan(self, experiment_id, master, version, rank, n, timeout_s) -> dict:
        """Hello (the group held), then the trainer's plan for the version."""
        if self.tcp is None or master != self.master:
            host, port = master.rsplit(":", 1)
            self.close()
            self.tcp, self.master = open_store(host, int(port), False, timeout_s), master
        hello = {"group": self.group_name, "rollouts": n, "holds": self.held}
        sees = self.device.type == "cpu" and self._sees(experiment_id)
        hello = json.dumps(hello | {"device": device_id(self.device), "shm": sees})
        self.tcp.set(_key(experiment_id, version, f"hello/{rank}"), hello)
        key = _key(experiment_id, version, "plan")
        self.tcp.wait([key], timedelta(seconds=timeout_s))
        info = json.loads(self.tcp.get(key))
        if info.get("skipped"):
            raise Unavailable(f"the trainer did not broadcast v{version}")
        return info

    def _done(self, key: str) -> None:
        """Tell the trainer its files may be packed again. A trainer gone since its plan
        (sealed before it was set) does not make the copy less whole: it is checked next."""
        try:
            self.tcp.set(key, "1")
        except RuntimeError as exc:
            log.warning("shm_done_not_told", error=f"{type(exc).__name__}: {exc}")

    def _sees(self, experiment_id: str) -> bool:
        """Whether the trainer advertised shared memory this process reads."""
        key = f"{experiment_id}/shm"
        return self.tcp.check([key]) and shm.sees(json.loads(self.tcp.get(key)))

    def _copy_out(self, p: buckets.Plan, staged: list[torch.Tensor], paths: list[str]):
        """Copy every bucket out of the trainer's shared files into the staging buffers; the
        checksums of the copies (what is checked is what is applied) and the bytes copied."""
        sums = []
        for i, (buf, path) in enumerate(zip(staged, paths, strict=True)):
            buf.copy_(self.maps.view(path, buf.numel()))
            if self.corrupt is not None:
                self.corrupt(i, buf)
            sums.append(buckets.checksum(buckets.raw(_view(buf, s)) for s in p.bucket(i)))
        self.maps.keep(paths)
        return sums, sum(p.sizes)

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

    @property
    def held(self) -> str:
        """The fingerprint of the newest version received ("" none or unknown)."""
        return self.staging.held

    def close(self) -> None:
        """Leave the group (the store connection stays)."""
        if self.group is not None:
            self.group.close()
        self.group, self.group_name = None, ""


def _view(buf: torch.Tensor, s: buckets.Slot) -> torch.Tensor:
    return buf[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)


class Staging:
    """Two sets of staging buffers in turn: a version is received into the set the newest
    version is not in, and the engine takes that set's tensors as its weights (no copy:
    `swap_weights(adopt=True)`), so the set it serves from is never written while it is.

    The newest set's fingerprint is the hello's `holds`: a delta version is written onto a copy
    of it (`base`). `forget` when its content may change outside this (the engine loads a
    version from the store into its weights, the newest set's tensors)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._plan: buckets.Plan | None = None
        self._sets: list[list[torch.Tensor]] = []
        self._holds = ["", ""]
        self._newest: int | None = None
        self._target = 0

    @property
    def held(self) -> str:
        return "" if self._newest is None else self._holds[self._newest]

    @property
    def newest(self) -> list[torch.Tensor]:
        """The newest version's set (the engine serves from it once it took it); [] none."""
        return [] if self._newest is None else self._sets[self._newest]

    def target(self, p: buckets.Plan) -> list[torch.Tensor]:
        """The set the next version goes into (allocated for plan `p`)."""
        if self._plan != p:
            self._plan, self._newest, self._holds = p, None, ["", ""]
            self._sets = [self._alloc(p), self._alloc(p)]
        self._target = 0 if self._newest is None else 1 - self._newest
        self._holds[self._target] = ""  # it changes from here on
        return self._sets[self._target]

    def _alloc(self, p: buckets.Plan) -> list[torch.Tensor]:
        return [torch.empty(n, dtype=torch.uint8, device=self.device) for n in p.sizes]

    def base(self, fingerprint: str) -> None:
        """Put the newest version, of `fingerprint`, into the target set (a delta's base)."""
        if self._newest is None or self._holds[self._newest] != fingerprint:
            return  # not held: the delta's checksums fail, and the next version goes whole
        for dst, src in zip(self._sets[self._target], self._sets[self._newest], strict=True):
            dst.copy_(src)

    def took(self, fingerprint: str) -> None:
        """The target set holds the version of `fingerprint`, checked: now the newest."""
        self._holds[self._target] = fingerprint
        self._newest = self._target

    def forget(self) -> None:
        self._holds = ["", ""]
