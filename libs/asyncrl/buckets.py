"""A version as fixed-size buckets of flattened tensors (`trainer.weight_sync: broadcast`), and
the proof of what arrived.

`plan` lays the tensors of a version (name, dtype, shape; in name order) into buckets of at
most `bucket_bytes`: each tensor at an offset aligned to `ALIGN` bytes inside one flat byte
buffer (a tensor larger than a bucket gets a bucket of its own). Both ends derive the same plan
from the same metadata, the trainer packs its parameters into the buckets, and each bucket is
one broadcast.

`plan(..., packed=True)` is the layout SGLang's `FlattenedTensorBucket` reconstructs (the
`flattened_bucket` load format of `trainer.weight_sync: nccl`): the tensors back to back with no
padding, each at an offset that is a multiple of its dtype's itemsize; a tensor that would land
misaligned starts a new bucket, and each bucket's buffer is exactly its tensors' bytes.

Each bucket's checksum is xxh3-64 over its tensors' bytes, in plan order (the alignment padding
is not part of it), computed by the trainer as it packs and by an engine as it receives. The
version's fingerprint (`fingerprint`) is one xxh3-128 over the plan and the bucket checksums,
named with the bucket size: `xxh3/b<bucket_bytes>:<hex>`. The same fingerprint comes from the
tensors anywhere else (`fingerprint_of_state`: the weight store's copy, an engine's live
weights), so an engine that loads the version from the store proves it the same way. xxh3 runs
at several GB/s per core (bench `weights` measures it); sha256 (`asyncrl.fingerprint`'s default
kind) at ~1.4.

A bucket may also travel as a delta against the same bucket of the previous version
(`encode_delta`, `apply_delta`): the 4-byte words that changed, their indices then their new
values in one int32 tensor. Padded bucket buffers are a multiple of `ALIGN` bytes (the padding at the
end is zeros on the trainer and not part of the checksum), so every bucket is whole words.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import torch

ALIGN = 8
"""Every tensor starts at a multiple of this many bytes in its bucket (any dtype's view), and
every bucket buffer is a multiple of it long."""
WORD = 4
"""A delta compares buckets in words of this many bytes (int32)."""
PROBE_STRIDE, PROBE_MIN = 61, 1024
"""`encode_delta` first compares every PROBE_STRIDE-th word of a bucket of at least
PROBE_STRIDE x PROBE_MIN words: a dense change (an fp32 step changes nearly every word) costs
that probe, not a compare of the whole bucket (0.25 s per SmolLM2 version on one thread)."""
PREFIX = "xxh3/b"
"""A bucket fingerprint starts with this, then the bucket size, ':' and the hash."""

_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


@dataclass(frozen=True)
class Slot:
    """One tensor's place: its bucket, its byte offset and size there."""

    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Plan:
    """Where every tensor of a version goes; `sizes[i]` is bucket i's buffer size in bytes (its
    tensors' extent, rounded up to `ALIGN` unless `packed`)."""

    bucket_bytes: int
    slots: tuple[Slot, ...]
    sizes: tuple[int, ...]
    packed: bool = False
    """No padding: `plan(..., packed=True)` (module docstring)."""

    @property
    def nbytes(self) -> int:
        """The tensors' bytes (what a version moves, padding left out)."""
        return sum(s.nbytes for s in self.slots)

    def bucket(self, i: int) -> list[Slot]:
        return [s for s in self.slots if s.bucket == i]

    def to_json(self) -> str:
        data = {
            "bucket_bytes": self.bucket_bytes,
            "tensors": [[s.name, s.dtype, list(s.shape)] for s in self.slots],
        }
        if self.packed:  # absent otherwise: a padded plan's fingerprint stays what it was
            data["packed"] = True
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        metas = [(name, dtype, tuple(shape)) for name, dtype, shape in data["tensors"]]
        return plan(metas, data["bucket_bytes"], packed=data.get("packed", False))


def nbytes_of(dtype: str, shape: Iterable[int]) -> int:
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype {dtype!r} cannot be bucketed (one of {sorted(_ITEMSIZE)})")
    n = _ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


def plan(
    metas: Iterable[tuple[str, str, tuple[int, ...]]], bucket_bytes: int, packed: bool = False
) -> Plan:
    """The buckets of tensors `metas` (name, torch dtype name, shape), laid out in name order:
    each tensor `ALIGN`-aligned, or back to back when `packed` (module docstring)."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
    slots: list[Slot] = []
    sizes: list[int] = []
    for name, dtype, shape in sorted(metas):
        n = nbytes_of(dtype, shape)
        offset = sizes[-1] if sizes else 0
        full = offset + n > bucket_bytes and offset > 0
        if not sizes or full or (packed and offset % _ITEMSIZE[dtype]):
            sizes.append(0)
            offset = 0
        slots.append(Slot(name, dtype, tuple(shape), len(sizes) - 1, offset, n))
        sizes[-1] = offset + n if packed else -(-(offset + n) // ALIGN) * ALIGN
    return Plan(bucket_bytes, tuple(slots), tuple(sizes), packed)


def plan_of_state(
    state: Mapping[str, torch.Tensor], bucket_bytes: int, packed: bool = False
) -> Plan:
    return plan(
        ((k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in state.items()),
        bucket_bytes,
        packed,
    )


def checksum(views: Iterable[memoryview]) -> int:
    """xxh3-64 of the byte views, one after the other (a bucket's tensors)."""
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def fingerprint(p: Plan, checksums: Iterable[int]) -> str:
    """The version's fingerprint: its plan and its buckets' checksums, hashed."""
    h = xxhash.xxh3_128(p.to_json().encode())
    h.update(json.dumps(list(checksums)).encode())
    return f"{PREFIX}{p.bucket_bytes}:{h.hexdigest()}"


def bucket_bytes_of(fp: str) -> int | None:
    """The bucket size a bucket fingerprint was made with; None for another kind."""
    if not fp.startswith(PREFIX):
        return None
    return int(fp[len(PREFIX) :].split(":", 1)[0])


def raw(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy (a GPU tensor is copied to the host first)."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def fingerprint_of_state(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> str:
    """The bucket fingerprint of tensors held anywhere (equal to the streamed one)."""
    p = plan_of_state(state, bucket_bytes)
    sums = [checksum(raw(state[s.name]) for s in p.bucket(i)) for i in range(len(p.sizes))]
    return fingerprint(p, sums)


def encode_delta(new: torch.Tensor, old: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """Bucket buffer `new` against `old` (uint8, the same size, whole words): how many words
    differ, and the delta: one int32 tensor of those k word indices, then their k values in
    `new`. None instead when the delta is not smaller than the bucket (send it whole); a large
    bucket where half the words of a strided probe differ goes whole at once (k then estimated
    from the probe)."""
    import torch

    a, b = new.view(torch.int32), old.view(torch.int32)
    if a.numel() >= PROBE_STRIDE * PROBE_MIN:  # most words changed (an fp32 step): whole
        probe = a[::PROBE_STRIDE] != b[::PROBE_STRIDE]
        k = int(torch.count_nonzero(probe))
        if 2 * k >= probe.numel():
            return k * a.numel() // probe.numel(), None
    changed = a != b
    k = int(torch.count_nonzero(changed))  # a bool tensor's sum() is 20x slower on the CPU
    if 2 * k >= a.numel() or a.numel() > torch.iinfo(torch.int32).max:
        return k, None
    (at,) = torch.nonzero(changed, as_tuple=True)
    return k, torch.cat([at.to(torch.int32), a[at]])


def apply_delta(buf: torch.Tensor, delta: torch.Tensor) -> None:
    """Write an `encode_delta` delta into bucket buffer `buf` (uint8, in place)."""
    import torch

    k = delta.numel() // 2
    buf.view(torch.int32)[delta[:k].long()] = delta[k:]


def delta_nbytes(words: int) -> int:
    """The bytes of a delta of `words` changed words (an index and a value each)."""
    return 2 * WORD * words


class BufferSets:
    """Two sets of bucket buffers, packed in turn: one version may still be in flight (sent,
    written) while the next is packed, never two. `alloc(nbytes)` makes a CPU buffer where it
    is given and answers (shared memory: `asyncrl.shm`; None: an ordinary one), and
    `free` lets one go when its set is reallocated."""

    def __init__(self, alloc=None, free=None):
        self._sets: dict[int, list[torch.Tensor]] = {}
        self._packed = 0
        self._alloc, self._free = alloc, free

    def next(self, p: Plan, device: torch.device) -> list[torch.Tensor]:
        """The set the next version is packed into, (re)allocated when `p`'s sizes changed."""
        self._packed += 1
        buffers = self._sets.get(self._packed % 2)
        if buffers is None or [b.numel() for b in buffers] != list(p.sizes):
            if buffers and self._free:
                for old in buffers:
                    self._free(old)
            buffers = [self._new(n, device) for n in p.sizes]
            self._sets[self._packed % 2] = buffers
        return buffers

    def _new(self, nbytes: int, device: torch.device) -> torch.Tensor:
        import torch

        buf = self._alloc(nbytes) if self._alloc and device.type == "cpu" else None
        return buf if buf is not None else torch.zeros(nbytes, dtype=torch.uint8, device=device)
